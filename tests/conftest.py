import os
import sys
from pathlib import Path

# Before torch loads OpenMP: idle worker threads sleep instead of spinning. The CLI does the same
# (pagedchat/threads.py); in a test process spinning threads steal the cores of the servers and CLI
# subprocesses the tests start, and of anything else running on the machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Which path a CPU step takes (native or torch) is otherwise measured, so it would depend on timing and on which
# tests ran first (the decisions are shared by the session's build folder); the two paths sum in different
# orders (and the native step multiplies GGUF blocks with 8-bit activations), so a test's tokens could change
# with how busy the machine is. The tests take the native step wherever it applies, as the measurement picks for
# their tiny models; a test that needs the torch path, or the measurement itself, says so.
os.environ.setdefault("PAGEDCHAT_NATIVE", "always")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def _hypothesis_profiles():
    from hypothesis import HealthCheck, settings

    # "ci" (the default): every run, on every machine, draws the same examples, so no run fails for the luck
    # of a fresh seed and a failure reproduces by running the test again (derandomize implies no example
    # database either: what one checkout once found does not make its runs differ from a clean one's).
    # Nothing is timed: no deadline, no "too slow" health check (a busy machine must not fail a test). A
    # failure prints the blob that replays it.
    untimed = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    settings.register_profile("ci", derandomize=True, **untimed)
    # "explore": random draws, for `--hypothesis-seed=N` (derandomize would ignore the seed) and for fuzzing
    # sessions (PAGEDCHAT_FUZZ_EXAMPLES / PAGEDCHAT_FUZZ_STEPS, see test_engine_state_machine.py): hypothesis
    # prints what reproduces a failure and keeps it in its database (.hypothesis/) to try first next time.
    settings.register_profile("explore", **untimed)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The hypothesis profile, unless --hypothesis-profile names one (see _hypothesis_profiles). Ctrl-C raises
    KeyboardInterrupt, as in a terminal, however the tests were started: a process started in the background by a
    shell inherits SIGINT ignored, and Python then leaves it so (the tests of Ctrl-C would see nothing)."""
    import signal

    from hypothesis import settings

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    _hypothesis_profiles()
    if config.getoption("--hypothesis-profile", None):
        return
    fuzzing = any(os.environ.get(name) for name in ("PAGEDCHAT_FUZZ_EXAMPLES", "PAGEDCHAT_FUZZ_STEPS"))
    seeded = config.getoption("--hypothesis-seed", None) is not None
    settings.load_profile("explore" if fuzzing or seeded else "ci")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    """Each test's outcome as it comes, one JSON line in $PAGEDCHAT_TEST_OUTCOMES: a run stopped at its time limit
    (the GPU check's tests step) keeps what it learnt, failure messages included. Under xdist the controller
    writes it (it hears every worker's reports; a worker writing too would count each test twice)."""
    path = os.environ.get("PAGEDCHAT_TEST_OUTCOMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and report.passed):
        return
    import json

    outcome = "error" if report.failed and report.when != "call" else report.outcome   # pytest's own words
    line = {"test": report.nodeid, "outcome": outcome, "message": report.longreprtext[-2000:] if report.failed else ""}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(scope="session", autouse=True)
def xdg_cache_for_the_session(tmp_path_factory):
    """Engines built by module- and session-scoped fixtures (before `xdg_home` runs) keep their disk KV
    tier in a temporary folder too, never in the user's ~/.cache. The native decode step is built once for
    the session, in a folder every test and every CLI subprocess shares (each test's own cache folder would
    otherwise start a background build in every subprocess that loads a model)."""
    from pagedchat.native import build

    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("session-cache")))
    patch.setenv(build.CACHE_ENV, str(tmp_path_factory.mktemp("native-build")))
    # a test module that loaded the library while being collected loaded the user's build: this folder's now
    patch.setattr(build, "_loaded", None)
    build.load(wait=True)
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test starts from the same torch seed: a test that draws random inputs without seeding them draws
    the same ones whichever tests ran before it (and alone)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def xdg_home(tmp_path, monkeypatch):
    """Every test gets its own config, data and cache folders: none reads or writes the real user's (the
    cache holds the disk KV tier)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def pagedchat_cli(capsys, monkeypatch):
    """The real `pagedchat` entry point in-process: cli(*args, stdin=None) -> (exit code, stdout, stderr)."""
    from cli_util import invoke

    return lambda *args, stdin=None: invoke(list(args), stdin, capsys, monkeypatch)


@pytest.fixture
def typer_cli():
    """pagedchat's typer app through typer's CliRunner: cli(*args, input=None) -> click Result."""
    from typer.testing import CliRunner

    from pagedchat.cli import app

    runner = CliRunner()
    return lambda *args, input=None: runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """One tiny random HF model per architecture, built once per test session."""
    from hf_models import ARCHS, NEW_FAMILIES, build_model

    root = tmp_path_factory.mktemp("models")
    return {arch: (root / arch, build_model(arch, root / arch)) for arch in ARCHS + NEW_FAMILIES}


@pytest.fixture(scope="session")
def model(model_dirs):
    """The tiny llama chat model (ChatML template) most CLI and chat tests run on. Shared by the whole
    session, so read-only: a test that changes files copies it first."""
    return model_dirs["llama"][0]
