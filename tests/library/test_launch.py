"""The launcher (minizero/launch.py): results, output, failures, timeouts, notebooks, torchrun."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minizero
from minizero.launcher import LaunchError, LaunchTimeout, gpu_count, launch

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


# --- what the ranks run (module level, so that torchrun workers can import them) ---------------


def where(x, y=0):
    return dist.get_rank(), dist.get_world_size(), x, y


def chatty():
    print(f"hello from {dist.get_rank()}")
    print(f"careful, {dist.get_rank()}", file=sys.stderr)
    for _ in range(1000):
        print("x" * 1000)  # 1 MB per rank: nothing may block on a full pipe


def note_pid(pid_dir: Path) -> None:
    (pid_dir / f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # every rank has written its pid


def fail_on_1(pid_dir: Path):
    note_pid(pid_dir)
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)  # rank 0 waits here; launch must stop it


def hang_on_1():
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


def exit_on_1(pid_dir: Path):
    note_pid(pid_dir)
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def unpicklable():
    return threading.Lock()


def all_reduce_cuda():
    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return torch.cuda.current_device(), dist.get_backend(), t.cpu().tolist()


def gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` no longer runs (a zombie counts as gone)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("*.pid"))]


def run_script(tmp_path: Path, code: str, *args: str, timeout: float = 90):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


# --- results and output ------------------------------------------------------------------------


def test_results_in_rank_order(capsys):
    assert minizero.launch(where, 3, "a", y=5) == [(r, 3, "a", 5) for r in range(3)]
    assert capsys.readouterr().out == "minizero.launch: 3 ranks, gloo on CPU (fork)\n"


def test_output_is_relayed_with_rank_prefix(capsys):
    assert launch(chatty, 2, verbose=False) == [None, None]
    out, err = capsys.readouterr()
    assert not out.startswith("minizero.launch")  # verbose=False
    assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out
    assert "[rank 1] careful, 1\n" in err
    assert out.count("[rank 1] " + "x" * 1000 + "\n") == 1000


def test_concurrent_launches_do_not_clash():
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch, where, 2, i, verbose=False) for i in range(4)]
        assert [f.result() for f in futures] == [[(0, 2, i, 0), (1, 2, i, 0)] for i in range(4)]


# --- choices and argument errors ---------------------------------------------------------------


def test_backend_choice(capsys):
    gpus = gpu_count()
    if gpus:
        pytest.skip("checks the choice on a machine without GPUs")
    launch(where, 2, 0)
    assert "2 ranks, gloo on CPU (fork)" in capsys.readouterr().out
    with pytest.raises(
        ValueError, match=r"backend='nccl' needs one GPU per rank: nprocs=2 but 0 GPUs"
    ):
        launch(where, 2, 0, backend="nccl")


@pytest.mark.parametrize(
    "nprocs, kw, message",
    [
        (0, {}, "nprocs must be a positive int, got 0"),
        (-1, {}, "nprocs must be a positive int, got -1"),
        (2, {"backend": "foo"}, "unknown backend 'foo': use 'auto', 'gloo' or 'nccl'"),
        (2, {"mechanism": "spawn"}, "unknown mechanism 'spawn'"),
    ],
)
def test_bad_arguments(nprocs, kw, message):
    with pytest.raises(ValueError, match=message):
        launch(where, nprocs, 0, **kw)


@pytest.mark.parametrize(
    "timeout, error",
    [
        (None, TypeError),
        ("300", TypeError),
        (True, TypeError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (0, ValueError),
        (-5.0, ValueError),
        (timedelta(0), ValueError),
    ],
)
def test_timeout_must_be_finite_and_positive(timeout, error):
    if error is TypeError:
        message = f"timeout must be a number of seconds or a timedelta, got {timeout!r}: "
        message += "pass e.g. timeout=600 (there is no unlimited timeout)"
    else:
        message = f"timeout must be a finite number of seconds > 0, got {timeout!r}: pass a large "
        message += (
            "number (e.g. timeout=24 * 3600) to wait long; a hung rank is then still reported"
        )
    with pytest.raises(error) as info:
        launch(where, 2, 0, timeout=timeout, verbose=False)
    assert str(info.value) == message


def test_timeout_may_be_a_timedelta_or_an_int():
    assert launch(where, 2, 0, timeout=timedelta(minutes=2), verbose=False)[1] == (1, 2, 0, 0)
    assert launch(where, 1, 0, timeout=60, verbose=False) == [(0, 1, 0, 0)]


# --- failures ----------------------------------------------------------------------------------


def test_rank_failure_names_rank_carries_traceback_and_stops_the_others(tmp_path, capsys):
    with pytest.raises(LaunchError) as info:
        launch(fail_on_1, 2, tmp_path, verbose=False)
    assert "trying again" not in capsys.readouterr().err  # fn had started: never run twice
    e = info.value
    assert isinstance(e, RuntimeError) and e.rank == 1
    assert str(e).startswith("rank 1 failed; the other unfinished ranks [0] were stopped.")
    assert 'raise ValueError("rank one is broken")' in e.traceback
    assert e.traceback in str(e)
    assert len(pids(tmp_path)) == 2 and all(gone(p) for p in pids(tmp_path))


def leaves_then_fails_on_0(tmp: Path) -> None:
    """Rank 0 closes its connections and raises its own error a second later; rank 1's all-reduce
    meanwhile fails on the broken connection, so the consequence's traceback comes in first."""
    if dist.get_rank() == 0:
        dist.destroy_process_group()
        (tmp / "left").touch()
        time.sleep(1.0)
        raise ValueError("rank 0's own mistake")
    while not (tmp / "left").exists():
        time.sleep(0.01)
    dist.all_reduce(torch.ones(1))


def test_a_peers_broken_connection_never_hides_the_rank_that_failed(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(leaves_then_fails_on_0, 2, tmp_path, verbose=False, timeout=60)
    e, said = info.value, str(info.value)
    assert e.rank == 0 and "ValueError: rank 0's own mistake" in e.traceback, said
    assert said.startswith("rank 0 failed; ranks [1] then failed as a consequence, their "
                           "connection to a failed rank broken (rank 1: "), said  # fmt: skip
    assert "Connection closed by peer" not in e.traceback


def test_broken_connections_are_told_from_a_ranks_own_error():
    from minizero.launcher import broken_connection

    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:538] Connection closed by peer [::1]:5"
    mesh = "RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:144]"
    assert broken_connection(gloo) and broken_connection(mesh)
    own = (
        'Traceback ...\n  File "x.py", line 3\nValueError: Connection closed by peer is in the text'
    )
    assert not broken_connection(own.replace("Connection closed by peer", "bad shape"))
    assert not broken_connection("RuntimeError: size mismatch\n")


def test_a_rank_whose_result_landed_after_the_parent_looked_is_not_blamed(tmp_path):
    """The race the fast tier met under load: rank 2 wrote its result and exited 0 after the
    parent's last look, as rank 0 failed; the error names rank 0's, not "rank 2 exited"."""
    from minizero.launcher import _blame

    class Exited:  # every rank's process has ended: 0 and 2 with code 0, 1 stopped
        def settle(self): ...
        def crashed(self, done):
            return {r: "exited with code 0" for r in (0, 2) if r not in done}

        def wait(self, seconds): ...
        def stop(self, wait=0.0): ...

    class Relay:
        def pump(self, final=False): ...

    (tmp_path / "0.err").write_text("Traceback ...\nValueError: rank 0's own mistake\n")
    (tmp_path / "2.ok").write_bytes(b"result")  # landed after the parent last read the results
    e = _blame(Exited(), tmp_path, 3, {}, Relay())
    assert e.rank == 0 and str(e).startswith("rank 0 failed; the other unfinished ranks [1] "), e
    (tmp_path / "2.ok").unlink()  # without its result, rank 2's exit is the cause: the check holds
    assert str(_blame(Exited(), tmp_path, 3, {}, Relay())).startswith("rank 2 exited with code 0")


def test_setup_failure_is_retried_once(tmp_path, monkeypatch, capsys):
    real = dist.init_process_group

    def flaky(*args, **kwargs):  # forked ranks inherit the patch
        if kwargs["rank"] == 1 and not (tmp_path / "failed").exists():
            (tmp_path / "failed").touch()
            raise RuntimeError("Connection closed by peer (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky)
    assert launch(where, 2, 0, verbose=False) == [(0, 2, 0, 0), (1, 2, 0, 0)]
    assert capsys.readouterr().err == (
        "minizero.launch: the ranks could not connect "
        "(RuntimeError: Connection closed by peer (simulated)); trying again\n"
    )


@pytest.mark.timeout(60)
def test_hang_is_stopped_at_timeout_with_its_stack():
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_on_1, 2, timeout=6, verbose=False)  # rank 0 finishes well within 6 s
    e = info.value
    assert isinstance(e, TimeoutError) and isinstance(e, LaunchError)
    assert e.ranks == [1] and e.rank == 1
    assert str(e).startswith("timeout: ranks [1] had not finished after 6 s")
    assert "in hang_on_1" in e.traceback


def test_rank_that_exits_without_raising(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(exit_on_1, 2, tmp_path, verbose=False)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 exited with code 3 without returning a result")
    assert all(gone(p) for p in pids(tmp_path))


def test_unpicklable_result_is_explained():
    with pytest.raises(LaunchError, match="returned a lock that cannot be pickled"):
        launch(unpicklable, 1, verbose=False)


@pytest.mark.parametrize("mechanism", ["fork", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_keyboard_interrupt_leaves_no_rank_behind(tmp_path, mechanism):
    code = """
        import os, signal, sys, threading, time
        import torch.distributed as dist
        import minizero

        def sleeper(d):
            open(f"{d}/{dist.get_rank()}.pid", "w").write(str(os.getpid()))
            time.sleep(60)

        def interrupt(d):
            while len([f for f in os.listdir(d) if f.endswith(".pid")]) < 2:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        if __name__ == "__main__":
            # Ctrl-C as in a terminal: a job a shell started in the background ignores SIGINT
            signal.signal(signal.SIGINT, signal.default_int_handler)
            threading.Thread(target=interrupt, args=(sys.argv[1],), daemon=True).start()
            try:
                minizero.launch(sleeper, 2, sys.argv[1], mechanism=sys.argv[2])
            except KeyboardInterrupt:
                print("interrupted")
    """
    (tmp_path / "pids").mkdir()
    out = run_script(tmp_path, code, str(tmp_path / "pids"), mechanism)
    assert out.stdout.endswith("interrupted\n"), out.stderr
    assert len(pids(tmp_path / "pids")) == 2 and all(gone(p) for p in pids(tmp_path / "pids"))


@pytest.mark.parametrize("mechanism", ["fork", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_sigkill_of_the_parent_leaves_no_process_behind(tmp_path, mechanism):
    """A SIGKILLed parent cannot clean up: the ranks, and torchrun, must go by themselves."""
    code = """
        import os, sys, time
        import torch.distributed as dist
        import minizero

        def sleeper(d):  # leaves "<pid> <parent pid>": the parent is torchrun under torchrun
            f = f"{d}/{dist.get_rank()}.pid"
            open(f + ".part", "w").write(f"{os.getpid()} {os.getppid()}")
            os.replace(f + ".part", f)
            time.sleep(60)

        if __name__ == "__main__":
            minizero.launch(sleeper, 2, sys.argv[1], mechanism=sys.argv[2])
    """
    (tmp_path / "script.py").write_text(textwrap.dedent(code))
    (tmp_path / "pids").mkdir()
    cmd = [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pids"), mechanism]
    parent = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started: list[int] = []
    try:
        end = time.monotonic() + 90
        while len(files := sorted((tmp_path / "pids").glob("*.pid"))) < 2:
            assert parent.poll() is None, parent.stderr.read().decode()
            assert time.monotonic() < end, "the ranks did not start"
            time.sleep(0.05)
        for f in files:
            started += [int(pid) for pid in f.read_text().split()]
        started = sorted(set(started) - {parent.pid})  # the ranks, and torchrun if it ran
        assert len(started) == (2 if mechanism == "fork" else 3)
        parent.kill()
        parent.wait()
        left = [pid for pid in started if not gone(pid, within=5.0)]
        assert not left, f"still running 5 s after the parent was killed: {left}"
    finally:
        parent.kill()
        for pid in started:  # whatever this test started, gone before the next test
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_watchdog_kills_the_process_when_its_parent_dies(tmp_path):
    """Where there is no parent-death signal (not Linux), a thread watches the parent instead."""
    child = """
        import os, sys, time
        from minizero.launcher.ranks import die_with_parent
        sys.platform = "darwin"  # take the watchdog path here, on Linux too
        die_with_parent()
        sys.platform = "linux"
        open(sys.argv[1] + ".part", "w").write(str(os.getpid()))
        os.replace(sys.argv[1] + ".part", sys.argv[1])
        time.sleep(60)
    """
    parent = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)"
    pid_file = tmp_path / "child.pid"
    cmd = [sys.executable, "-c", parent, sys.executable, "-c", textwrap.dedent(child), pid_file]
    proc = subprocess.Popen(cmd, env=ENV)
    pid = None
    try:
        end = time.monotonic() + 90
        while not pid_file.exists():
            assert time.monotonic() < end and proc.poll() is None, "the child did not start"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert not gone(pid, within=0.5)  # its parent lives: it stays
        proc.kill()
        proc.wait()
        assert gone(pid, within=5.0)
    finally:
        proc.kill()
        if pid is not None:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# --- where fn comes from: __main__, notebooks --------------------------------------------------


@pytest.mark.slow
def test_function_defined_in_main(tmp_path):
    code = """
        from minizero.launcher import LaunchError  # importing the module must not hide the function
        import torch.distributed as dist
        import minizero

        def times_rank(k):
            return dist.get_rank() * k

        if __name__ == "__main__":
            print(minizero.launch(times_rank, 2, 10, verbose=False))
            print(minizero.launch(times_rank, 2, 10, verbose=False, mechanism="torchrun"))
    """
    out = run_script(tmp_path, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[0, 10]\n[0, 10]\n"


@pytest.mark.slow
def test_function_defined_in_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    define = "import minizero, torch.distributed as dist\n\ndef times_rank(k):\n"
    define += "    print('inside', dist.get_rank())\n    return dist.get_rank() * k"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(define),
        nbformat.v4.new_code_cell("print(minizero.launch(times_rank, 2, 10))"),
        nbformat.v4.new_code_cell("minizero.launch(times_rank, 2, 7, mechanism='torchrun')"),
    ]
    client = nbclient.NotebookClient(nb, timeout=90, resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert text.startswith("minizero.launch: 2 ranks, gloo on CPU (fork)\n")
    assert "[rank 0] inside 0\n" in text and "[rank 1] inside 1\n" in text
    assert text.endswith("[0, 10]\n")
    outputs = nb.cells[2].outputs
    assert "[rank 1] inside 1\n" in "".join(o.get("text", "") for o in outputs)
    assert [o["data"]["text/plain"] for o in outputs if "data" in o] == ["[0, 7]"]


# --- torchrun ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_mechanism_matches_fork(capsys):
    assert launch(where, 2, "a", y=5, mechanism="torchrun") == [(r, 2, "a", 5) for r in range(2)]
    assert "2 ranks, gloo on CPU (torchrun)" in capsys.readouterr().out


@pytest.mark.slow
def test_torchrun_mechanism_reports_failure(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(fail_on_1, 2, tmp_path, mechanism="torchrun", verbose=False)
    assert info.value.rank == 1
    assert 'raise ValueError("rank one is broken")' in info.value.traceback
    assert len(pids(tmp_path)) == 2 and all(gone(p) for p in pids(tmp_path))


@pytest.mark.slow
def test_script_runs_unchanged_under_minizero_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        import torch.distributed as dist
        import minizero

        def times_rank(k):
            if sys.argv[1:] == ["fail"] and dist.get_rank() == 1:
                raise ValueError("rank one is broken")
            return dist.get_rank() * k

        out = minizero.launch(times_rank, 2, 10)
        sys.stdout.write(f"RANK {os.environ['RANK']} {out}\\n")  # one write: ranks share stdout
    """)
    )
    cmd = [sys.executable, "-m", "minizero", "run", "--nproc-per-node=2", str(script)]
    ok = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=90)
    assert ok.returncode == 0, ok.stderr
    assert "RANK 0 [0, 10]" in ok.stdout and "RANK 1 [0, 10]" in ok.stdout
    assert "minizero.launch: under torchrun, 2 ranks, gloo" in ok.stdout
    bad = subprocess.run([*cmd, "fail"], capture_output=True, text=True, env=ENV, timeout=90)
    assert bad.returncode != 0
    assert "LaunchError: rank 1 failed" in bad.stderr


# --- GPUs --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nccl_one_rank_per_gpu(capsys):
    n = gpu_count()
    out = launch(all_reduce_cuda, n)
    assert f"{n} ranks, nccl on one GPU per rank (torchrun)" in capsys.readouterr().out
    assert out == [(r, "nccl", [n * (n + 1) / 2] * 4) for r in range(n)]
