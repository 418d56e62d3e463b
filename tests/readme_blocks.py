"""The README's command blocks, split into commands, each either run or skipped by a named rule.

A fenced block's info string says what it is:

- ```` ```bash ````: commands to paste in the checkout, in order. Each command (``\\``
  continuations joined, ``# comments`` dropped) is RUN unless a rule of :data:`SKIP_RULES`
  matches it; the rule's reason is the reason it is not run. A command that no rule matches
  is run: nothing is skipped without a named reason.
- ```` ```text ````: output or a file layout, not commands.
- ```` ```python ````: Python code, RUN as pasted, as one command (``python`` of the activated
  venv reading the block on its stdin), in order with the shell commands around it, so that it
  reads what the commands before it made. The one exception is named: a block that is a whole
  file of ``examples/`` (the Beam pipeline example, ``examples/beam_pipeline.py``) is that
  file, run by its own test with data (``tests/test_readme_example.py``).

A fence without an info string, or an indented code block, is an error
(:func:`readme_blocks` raises): every block must say what it is.

:data:`PROMISED_EXITS` lists the non-zero exits the README promises for a command that is run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COMMAND_INFO = ("bash",)
PYTHON_INFO = "python"
OTHER_INFO = ("text", PYTHON_INFO)
PYTHON_HEREDOC = "README_PYTHON_BLOCK"  # the here-document's delimiter a Python block is fed through


@dataclass(frozen=True)
class Rule:
    """Commands matching ``pattern`` (a regular expression, searched) are not run, for ``reason``."""
    pattern: str
    reason: str

    def matches(self, command: str) -> bool:
        return re.search(self.pattern, command) is not None


# First match wins. The placeholders are the ones the README names as standing for your own.
SKIP_RULES: tuple[Rule, ...] = (
    Rule(r"^make test\b", "runs the test suite this test is part of"),
    Rule(r"^pip install\b", "installs from a package registry (make test installs the extras in the test's .venv)"),
    Rule(r"gs://", "needs the network: Google Cloud Storage (and a Google Cloud project)"),
    Rule(r"\bgpt-oss-(20b|120b)\b", "needs a real gpt-oss checkpoint (13-65 GB) and a GPU"),
    Rule(r"(^|\s)corpus/", "placeholder: corpus/ stands for your own corpus"),
    Rule(r"--config mix\.toml\b", "placeholder: mix.toml stands for your own mixture file"),
)


@dataclass(frozen=True)
class Exit:
    """A command matching ``pattern`` exits ``code``, as the README says it does."""
    pattern: str
    code: int
    why: str


# None today: every command run here exits 0 (`verify`'s "exit 1" is for a damaged output; the
# README's are whole). A command the README shows failing on purpose gets its Exit here.
PROMISED_EXITS: tuple[Exit, ...] = ()


@dataclass(frozen=True)
class Block:
    line: int  # README line of the opening fence
    info: str  # the fence's info string: bash, text, python
    lines: tuple[str, ...]  # its lines, without the fences


@dataclass(frozen=True)
class Command:
    line: int  # README line where the command starts
    text: str  # the command, continuations joined, comment dropped
    skip: str | None  # the reason it is not run (a rule's), or None: it is run
    exit_code: int = 0  # the exit the README promises

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.text}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order. Raises ValueError naming the line of
    a fence without an info string, an unknown info string, an unclosed fence, or an
    indented code block (four spaces after a blank line, outside a list)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            info = line[3:].strip()
            if info not in COMMAND_INFO + OTHER_INFO:
                raise ValueError(f"README.md:{i + 1}: a fenced block must say what it is: "
                                 f"```{'/```'.join(COMMAND_INFO + OTHER_INFO)}, not {line!r}")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"README.md:{i + 1}: a fenced block that is never closed")
            blocks.append(Block(i + 1, info, tuple(lines[i + 1:end])))
            i = end + 1
            continue
        if (line.startswith("    ") and line.strip() and i > 0 and not lines[i - 1].strip()
                and not _in_list(lines, i)):
            raise ValueError(f"README.md:{i + 1}: an indented code block: fence it (```bash, ```text...)")
        i += 1
    return blocks


def _in_list(lines: list[str], i: int) -> bool:
    """Whether line ``i`` continues a list item (the nearest unindented line above is one)."""
    for j in range(i - 1, -1, -1):
        if lines[j].strip() and not lines[j].startswith(" "):
            return re.match(r"([-*]|\d+\.) ", lines[j]) is not None
    return False


def split_commands(block: Block) -> list[tuple[int, str]]:
    """(README line, command) of a command block: ``\\`` continuations joined, comments and
    blank lines dropped."""
    commands: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for k, raw in enumerate(block.lines):
        line = strip_comment(raw).rstrip()
        if not parts:
            start = block.line + 1 + k
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line.strip())
        command = " ".join(p for p in parts if p)
        parts = []
        if command:
            commands.append((start, command))
    if parts:
        raise ValueError(f"README.md:{start}: a command continued (\\) past the end of its block")
    return commands


def strip_comment(line: str) -> str:
    """The line without a shell comment: a ``#`` at the start of a word, outside quotes."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def classify(command: str) -> str | None:
    """The reason ``command`` is not run (the first matching rule's), or None: it is run."""
    return next((rule.reason for rule in SKIP_RULES if rule.matches(command)), None)


def promised_exit(command: str) -> int:
    return next((e.code for e in PROMISED_EXITS if re.search(e.pattern, command)), 0)


def python_command(block: Block, examples: dict[str, str]) -> Command:
    """A Python block as one shell command: ``python`` reading the block as pasted from a
    here-document. Not run only when it is a whole file of ``examples/`` (``examples``: each
    file's text by its path), which that file's own test runs."""
    code = "\n".join(block.lines) + "\n"
    if PYTHON_HEREDOC in code:
        raise ValueError(f"README.md:{block.line}: a Python block may not hold {PYTHON_HEREDOC}")
    same = next((path for path, text in examples.items() if text == code), None)
    skip = f"the whole of {same}, run by tests/test_readme_example.py with its data" if same else None
    return Command(block.line + 1, f"python - <<'{PYTHON_HEREDOC}'\n{code}{PYTHON_HEREDOC}", skip)


def readme_commands(readme: Path) -> list[Command]:
    """Every command of the README's command blocks and every Python block, in order, classified."""
    examples = {f"examples/{p.name}": p.read_text(encoding="utf-8")
                for p in sorted((readme.parent / "examples").glob("*.py"))}
    commands = []
    for block in readme_blocks(readme.read_text(encoding="utf-8")):
        if block.info in COMMAND_INFO:
            for line, text in split_commands(block):
                commands.append(Command(line, text, classify(text), promised_exit(text)))
        elif block.info == PYTHON_INFO:
            commands.append(python_command(block, examples))
    return commands
