"""Following a Ray job to its end: the launcher returns as soon as the job's status is final and
still prints every line of its log, once. Ray's job client is stood in for by a small fake whose
log stream, like Ray's, stays open well after the job has ended."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from miles.launcher.job_submit import _follow_until_ended, _JobOutput


@dataclass
class _Status:
    terminal: bool

    def is_terminal(self) -> bool:
        return self.terminal


@dataclass
class _Info:
    status: _Status


class _SlowClosingJob:
    """Streams `streamed`, then keeps the stream open for `linger_s`; the status turns final
    after `runs_s`; the log file holds `whole_log`."""

    def __init__(self, streamed: list[str], whole_log: str, runs_s: float = 0.3, linger_s: float = 30.0):
        self.streamed, self.whole_log = streamed, whole_log
        self.ends_at = time.monotonic() + runs_s
        self.linger_s = linger_s

    async def tail_job_logs(self, job_id):
        for chunk in self.streamed:
            yield chunk
        await asyncio.sleep(self.linger_s)

    def get_job_info(self, job_id):
        return _Info(_Status(time.monotonic() >= self.ends_at))

    def get_job_logs(self, job_id):
        return self.whole_log


def _follow(client, tmp_path, secrets=()) -> tuple[str, float]:
    output = _JobOutput(tmp_path / "job.log", list(secrets))
    start = time.monotonic()
    asyncio.run(_follow_until_ended(client, "job", output, poll_s=0.05))
    output.close()
    return (tmp_path / "job.log").read_text(), time.monotonic() - start


def test_returns_once_the_job_has_ended_with_the_lines_the_stream_had_not_delivered(tmp_path, capsys):
    client = _SlowClosingJob(["step 1\n", "step 2\n"], "step 1\nstep 2\nresults: done\n")
    log, took = _follow(client, tmp_path)
    assert took < 5.0, f"waited {took:.1f} s for a log stream that stays open 30 s after the job ended"
    assert log == "step 1\nstep 2\nresults: done\n"
    assert capsys.readouterr().out == log


def test_a_stream_that_closes_by_itself_is_read_to_its_end_and_nothing_is_repeated(tmp_path):
    client = _SlowClosingJob(["a\n", "b\n"], "a\nb\n", runs_s=60.0, linger_s=0.0)
    log, took = _follow(client, tmp_path)
    assert log == "a\nb\n"
    assert took < 5.0


def test_the_rest_of_the_log_is_redacted_like_the_stream(tmp_path):
    client = _SlowClosingJob(["key s3cret-value\n"], "key s3cret-value\nlast s3cret-value\n")
    log, _ = _follow(client, tmp_path, secrets=["s3cret-value"])
    assert "s3cret-value" not in log
    assert log.count("\n") == 2


def test_a_log_file_that_disagrees_with_the_stream_is_shown_whole_after_a_note(tmp_path):
    client = _SlowClosingJob(["line from the stream\n"], "rewritten first line\nlast\n")
    log, _ = _follow(client, tmp_path)
    assert log.startswith("line from the stream\n")
    assert "disagree" in log
    assert log.endswith("rewritten first line\nlast\n")


@pytest.mark.parametrize("whole_log", ["", "a\n"])
def test_nothing_is_written_twice_when_the_stream_already_had_everything(tmp_path, whole_log):
    client = _SlowClosingJob([whole_log] if whole_log else [], whole_log)
    log, _ = _follow(client, tmp_path)
    assert log == whole_log
