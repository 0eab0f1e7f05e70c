"""How a rank tells its own failure from a collective failing because another rank went away."""

from __future__ import annotations

import pytest
from horovod.common.exceptions import HorovodInternalError

from hvdtrain.worker import peer_failed


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    "error",
    [
        HorovodInternalError("ncclAllReduce failed"),
        RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks"),
        RuntimeError(
            "[enforce fail at gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:1"
        ),
        _raised_from(HorovodInternalError("gloo"), RuntimeError("step 12 failed")),
    ],
    ids=["torch", "tf-shutdown", "gloo-peer", "chained"],
)
def test_a_collective_failing_on_a_lost_peer_is_the_peers_failure(error):
    assert peer_failed(error)


@pytest.mark.parametrize(
    "error",
    [ValueError("loss is nan at step 3"), RuntimeError("CUDA out of memory"), KeyError("image")],
)
def test_a_ranks_own_error_is_its_own(error):
    assert not peer_failed(error)
