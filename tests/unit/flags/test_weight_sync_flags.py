"""--weight-sync and --update-weight-buffer-size: the default, and what validation refuses."""

from __future__ import annotations

import pytest

from miles.flags.arguments import ConfigError, parse_args

BASE = ["--hf-checkpoint", "/ckpt/sd3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
        "--prompt-data", "prompts.jsonl"]


def test_bucketed_sync_is_the_default_with_a_512_mib_buffer_and_a_given_size_is_kept():
    args = parse_args(BASE)
    assert (args.weight_sync, args.update_weight_buffer_size) == ("bucketed", 512 * 1024 ** 2)
    assert parse_args([*BASE, "--update-weight-buffer-size", "65536"]).update_weight_buffer_size == 65536
    assert parse_args([*BASE, "--weight-sync", "object-store"]).update_weight_buffer_size is None


@pytest.mark.parametrize("size", ["0", "-1"])
def test_a_buffer_of_no_bytes_is_refused_naming_the_flag(size):
    with pytest.raises(ConfigError, match=rf"--update-weight-buffer-size {size}: .*fix: a positive number of bytes"):
        parse_args([*BASE, "--update-weight-buffer-size", size])


def test_a_buffer_size_with_object_store_sync_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="only bucketed sync uses a buffer; fix: drop --update-weight-buffer-size"):
        parse_args([*BASE, "--weight-sync", "object-store", "--update-weight-buffer-size", "1024"])
