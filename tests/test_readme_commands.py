"""Every command of the README's ```bash blocks works as pasted, in order, in a fresh copy of
the checkout (``tests/readme_blocks.py`` splits the blocks and names why a command is not run).

The copy holds the files ``git ls-files`` lists (tracked and untracked-but-not-ignored, as
they are on disk: a fresh clone of this work tree, uncommitted edits included). The commands
run one after another in ONE bash process started in the copy (so ``source
.venv/bin/activate`` carries over), each with its output logged and a time limit; the test
fails at the first command that exits other than the README promises, naming its README line.

What is simulated, and why: ``make demo`` would create ``.venv`` and pip-install refinery
with all its dependencies (minutes, GBs, a package registry). Instead the copy gets a
``.venv`` made by ``python -m venv --without-pip`` whose site-packages holds one ``.pth``
file: a folder whose only entry is ``refinery``, a link to the copy (``import refinery``
is the copy, as ``pip install -e .`` makes it), then this interpreter's site-packages (the
dependencies, already installed; their own ``.pth`` files are not run, so the editable
``refinery`` of this checkout is not imported). ``.venv/bin/refinery`` is the console
script pip would write. The Makefile's install step is done when its stamp
(``.venv/.installed``) is newer than ``setup.py``: the test writes that stamp, so ``make
demo`` runs everything after the install, as on a machine where it ran before. The shell's
environment is this one's less ``PYTHONPATH``, ``VIRTUAL_ENV`` and this venv's ``bin`` on
``PATH``, so nothing reaches this checkout's refinery.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from readme_blocks import SKIP_RULES, Block, classify, readme_blocks, readme_commands, split_commands

ROOT = Path(__file__).resolve().parents[1]
# A command that runs past its cap hangs: the cap guards against a hang, it does not check speed. The slowest
# command (hydra train judge, tiny model) takes 30-80 s on an idle 2-core machine, ran past 300 s at load 7-12 and
# took 803 s at load 12-18. So the cap is HANG_S, scaled up on a machine slower to start a command than an idle
# one (STARTUP_IDLE_S): the test's first command times a `refinery --help`, whose start-up every command pays.
HANG_S = 1800.0
STARTUP_IDLE_S = 1.5


def fresh_copy(dest: Path) -> Path:
    """The checkout's files as ``git`` sees them (tracked and untracked-not-ignored), copied."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the work tree is not in a clone of it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def prepared_venv(clone: Path, import_root: Path) -> Path:
    """``clone/.venv`` as ``make demo``'s install leaves it, without pip (see the module docstring)."""
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    import_root.mkdir()
    (import_root / "refinery").symlink_to(clone, target_is_directory=True)
    ours = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    (site / "refinery-readme-test.pth").write_text("\n".join([str(import_root), *dict.fromkeys(ours)]) + "\n")
    script = venv / "bin" / "refinery"
    script.write_text(f"#!{python}\nimport sys\nfrom refinery.beam_pipelines.cli import entry\n\n"
                      "if __name__ == '__main__':\n    sys.exit(entry())\n")
    script.chmod(0o755)
    (venv / ".installed").touch()  # the Makefile's stamp: the install step is done
    return venv


def clean_env() -> dict[str, str]:
    """This process's environment without what points at this checkout's refinery or venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("PYTEST_", "COV_"))}
    here = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != here)
    return env


class Shell:
    """One bash process; :meth:`run` feeds it a command and waits for its exit status."""

    def __init__(self, cwd: Path, log: Path, env: dict[str, str]) -> None:
        self.status_r, status_w = os.pipe()
        self.log = log.open("ab")
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(status_w,),
                                     start_new_session=True)
        os.close(status_w)
        self.status_fd = status_w
        self.buffer = b""

    def run(self, command: str, timeout: float) -> int | None:
        """The command's exit status, or None when it ran past ``timeout`` seconds."""
        script = f"{{\n{command}\n}} </dev/null\necho $? >&{self.status_fd}\n"
        stdin = self.proc.stdin
        assert stdin is not None  # a pipe
        stdin.write(script.encode())
        stdin.flush()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.status_r], [], [], left)[0]:
                return None
            chunk = os.read(self.status_r, 64)
            if not chunk:  # bash exited (e.g. a command ran `exit`)
                return self.proc.wait()
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return int(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self.status_r)
        self.log.close()


def command_cap(startup_s: float) -> float:
    """The time a README command may run before it is taken for hung: :data:`HANG_S`, times
    how much slower than an idle machine this one started ``refinery --help`` (``startup_s``)."""
    return HANG_S * max(1.0, startup_s / STARTUP_IDLE_S)


def test_every_readme_command_works_as_pasted(tmp_path: Path) -> None:
    commands = readme_commands(ROOT / "README.md")
    clone = fresh_copy(tmp_path / "refinery")
    prepared_venv(clone, tmp_path / "import-root")
    log = tmp_path / "commands.log"
    shell = Shell(clone, log, clean_env())
    timings = []
    try:
        began = time.monotonic()
        assert shell.run(".venv/bin/refinery --help >/dev/null", HANG_S) == 0, log.read_text()[-4000:]
        cap = command_cap(time.monotonic() - began)
        for command in commands:
            if command.skip:
                continue
            with log.open("a") as f:
                f.write(f"\n=== {command}\n")
            start = log.stat().st_size
            began = time.monotonic()
            rc = shell.run(command.text, cap)
            timings.append((time.monotonic() - began, command))
            said = log.read_bytes()[start:].decode(errors="replace")
            assert rc is not None, f"{command}\nran past {cap:.0f} s (hung?); its output:\n{said[-4000:]}"
            assert rc == command.exit_code, (
                f"{command}\nexited {rc} (the README promises {command.exit_code}); its output:\n{said[-4000:]}")
    finally:
        shell.close()
        print("\n".join(f"{s:6.1f} s  {c}" for s, c in timings))


def test_the_cap_only_guards_against_a_hang() -> None:
    """A busy machine gets more time per command, never less than :data:`HANG_S`."""
    assert command_cap(0.5) == command_cap(STARTUP_IDLE_S) == HANG_S
    assert command_cap(4 * STARTUP_IDLE_S) == 4 * HANG_S


def test_the_copy_imports_its_own_refinery(tmp_path: Path) -> None:
    """The simulated install: in the copy's venv, ``import refinery`` and the ``refinery``
    command are the copy's code, not this checkout's."""
    clone = fresh_copy(tmp_path / "refinery")
    venv = prepared_venv(clone, tmp_path / "import-root")
    (clone / "transforms" / "readme_probe.py").write_text("WHERE = __file__\n")
    said = subprocess.run(["bash", "-c", "source .venv/bin/activate && python -c "
                           "'from refinery.transforms import readme_probe; print(readme_probe.WHERE)'"
                           " && command -v refinery"],
                          cwd=clone, env=clean_env(), check=True, capture_output=True, text=True).stdout.split()
    assert Path(said[0]).resolve() == (clone / "transforms" / "readme_probe.py").resolve()
    assert Path(said[1]) == venv / "bin" / "refinery"


def test_a_block_must_say_what_it_is() -> None:
    assert [b.info for b in readme_blocks("```bash\nls\n```\n\n```text\nout/\n```\n")] == ["bash", "text"]
    with pytest.raises(ValueError, match="README.md:3: a fenced block must say what it is"):
        readme_blocks("text\n\n```\nls\n```\n")
    with pytest.raises(ValueError, match="README.md:3: an indented code block"):
        readme_blocks("text\n\n    ls -l\n")
    assert readme_blocks("- item\n\n    more of the item\n") == []  # a list item's second paragraph


def test_commands_join_continuations_and_drop_comments() -> None:
    block = Block(10, "bash", ("refinery prep --input a \\", "    --output 'b#c' # the output",
                               "# a comment line", "", "echo a#b   # shown"))
    assert split_commands(block) == [(11, "refinery prep --input a --output 'b#c'"), (15, "echo a#b")]


def test_a_command_no_rule_names_is_run() -> None:
    assert classify("refinery frobnicate --input examples/sample_corpus") is None
    assert classify("refinery prep --input corpus/ --output out/") is not None


def test_every_skip_rule_is_the_reason_for_a_readme_command() -> None:
    """No rule outlives the command it was written for: each is the first match of one."""
    used = {c.skip for c in readme_commands(ROOT / "README.md")}
    assert [r.pattern for r in SKIP_RULES if r.reason not in used] == []


def test_python_blocks_are_run_too_and_only_an_examples_file_is_not(tmp_path: Path) -> None:
    """The README's Python blocks failed as pasted when only its bash blocks were run: each is
    now a command of the run, in README order; a block that is a whole examples/ file is not
    run (its own test runs it: the Beam pipeline of docs/TRANSFORMS.md)."""
    from readme_blocks import PYTHON_HEREDOC

    commands = readme_commands(ROOT / "README.md")
    python = [c for c in commands if c.text.startswith(f"python - <<'{PYTHON_HEREDOC}'")]
    assert len(python) >= 3 and [c.line for c in commands] == sorted(c.line for c in commands)
    assert [c.skip for c in python if c.skip] == []
    assert any("prep_output_loader" in c.text for c in python)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "pipeline.py").write_text("print('a whole file')\n")
    (tmp_path / "README.md").write_text("```python\nprint('a whole file')\n```\n\n```python\nprint(1)\n```\n")
    assert [c.skip for c in readme_commands(tmp_path / "README.md")] == [
        "the whole of examples/pipeline.py, run by tests/test_readme_example.py with its data", None]
