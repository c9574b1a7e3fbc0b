"""The agent's batching at scale: the flush interval grows with the world size, so a job
of thousands of ranks sends a bounded number of POSTs a second, each with more steps."""

from __future__ import annotations

import pytest
from zerowatch.agent.config import (
    JOB_POSTS_PER_S,
    MAX_FLUSH_INTERVAL_S,
    MIN_FLUSH_INTERVAL_S,
    AgentConfig,
)


@pytest.mark.parametrize("world_size", [1, 8, 512, 1024, 4096, 8192, 1_000_000])
def test_the_flush_interval_keeps_a_job_near_its_rate_of_posts(world_size: int) -> None:
    interval = AgentConfig().flush_interval(world_size)
    assert MIN_FLUSH_INTERVAL_S <= interval <= MAX_FLUSH_INTERVAL_S
    if interval < MAX_FLUSH_INTERVAL_S:  # beyond the cap a step would wait too long
        assert world_size / interval <= JOB_POSTS_PER_S


def test_small_jobs_keep_the_two_second_interval_and_4096_ranks_post_every_16_s() -> None:
    assert AgentConfig().flush_interval(2) == 2.0
    assert AgentConfig().flush_interval(512) == 2.0
    assert AgentConfig().flush_interval(4096) == 16.0


def test_an_interval_given_by_the_user_wins_whatever_the_world_size() -> None:
    assert AgentConfig(flush_interval_s=0.5).flush_interval(4096) == 0.5


def test_a_bad_interval_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="flush_interval_s"):
        AgentConfig(flush_interval_s=0)
