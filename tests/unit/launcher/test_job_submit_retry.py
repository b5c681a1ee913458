"""Submitting while the job server has no agent yet: a head just up on a loaded machine answers
500 "No available agent to submit job, please try again later" (a suite run here failed a launch
on it); the launcher sends the same submission again until an agent answers, and no other refusal
is retried. Ray's job client is stood in for by a fake that refuses a set number of times."""

from __future__ import annotations

import pytest

from miles.launcher.job_submit import JobRequest, submit_when_an_agent_is_up

NO_AGENT = "Request failed with status code 500: No available agent to submit job, please try again later.."
REQUEST = JobRequest(address="http://127.0.0.1:8265", entrypoint="python3 train.py", env_vars={"A": "1"},
                     submission_id="miles-r1")


class _Client:
    def __init__(self, refusals: list[str]):
        self.refusals, self.calls = list(refusals), []

    def submit_job(self, **kw):
        self.calls.append(kw)
        if self.refusals:
            raise RuntimeError(self.refusals.pop(0))
        return kw["submission_id"]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_a_submission_refused_for_want_of_an_agent_is_sent_again_with_the_same_id_until_accepted():
    client, clock = _Client([NO_AGENT, NO_AGENT]), _Clock()
    assert submit_when_an_agent_is_up(client, REQUEST, clock=clock, sleep=clock.sleep) == "miles-r1"
    assert len(client.calls) == 3 and {c["submission_id"] for c in client.calls} == {"miles-r1"}
    assert client.calls[0]["runtime_env"] == {"env_vars": {"A": "1"}}


def test_no_agent_past_the_wait_and_any_other_refusal_are_raised_as_they_came():
    clock = _Clock()
    with pytest.raises(RuntimeError, match="No available agent"):
        submit_when_an_agent_is_up(_Client([NO_AGENT] * 100), REQUEST, wait_s=5, clock=clock, sleep=clock.sleep)
    assert clock.now == 5
    other = _Client(["Request failed with status code 401: Unauthenticated", NO_AGENT])
    with pytest.raises(RuntimeError, match="401"):
        submit_when_an_agent_is_up(other, REQUEST, clock=_Clock(), sleep=lambda s: None)
    assert len(other.calls) == 1
