"""A rank that never joins the process group (a lock inherited through fork, a worker that never
starts) is reported within seconds with where each rank was, and retried once: fn never ran."""

import time

import pytest
import torch.distributed as dist

import minizero.launcher as L  # the package (minizero.launch is the function)

LaunchError, launch = L.LaunchError, L.launch

pytestmark = pytest.mark.timeout(120)


def where():
    return dist.get_rank()


def _stuck_rank_1(monkeypatch, marker=None):
    """Rank 1 sleeps before joining (always, or only until ``marker`` exists): forked ranks
    inherit the patch."""
    real = dist.init_process_group

    def stuck_before_joining(*args, **kwargs):
        if kwargs["rank"] == 1 and (marker is None or not marker.exists()):
            if marker is not None:
                marker.touch()
            time.sleep(3600)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", stuck_before_joining)
    monkeypatch.setattr(L, "_JOIN", 2.5)  # twice (the retry) per launch: a healthy join takes 0.1 s
    monkeypatch.setattr(L, "_NOTICE", 1.0)


def test_a_rank_that_never_joins_is_reported_with_its_stack(monkeypatch, capsys):
    _stuck_rank_1(monkeypatch)
    with pytest.raises(LaunchError) as info:
        launch(where, 2, timeout=300, verbose=False)  # far beyond the test's own timeout
    e = info.value
    assert not isinstance(e, L.LaunchTimeout)
    assert str(e).startswith("ranks [0, 1] had not joined the process group after ")
    assert "the ranks never met, so fn never ran. Where they were:" in str(e)
    assert "in stuck_before_joining" in e.traceback  # rank 1's stack
    err = capsys.readouterr().err
    assert "minizero.launch: ranks [0, 1] had not joined the process group after 1 s" in err
    assert "minizero.launch: the ranks could not connect (ranks [0, 1] had not joined the " in err
    assert err.count("trying again") == 1  # once, then the error


def test_a_rank_stuck_once_is_retried_and_fn_runs_once(monkeypatch, tmp_path, capsys):
    _stuck_rank_1(monkeypatch, tmp_path / "stuck-once")
    assert launch(where, 2, timeout=300, verbose=False) == [0, 1]
    assert "had not joined the process group" in capsys.readouterr().err


def test_join_bound_leaves_slow_fn_alone(monkeypatch):
    monkeypatch.setattr(L, "_JOIN", 1.0)
    monkeypatch.setattr(L, "_NOTICE", 0.5)
    assert launch(_slow, 2, timeout=60, verbose=False) == [0, 1]  # fn runs past both


def _slow():
    time.sleep(3)
    return dist.get_rank()
