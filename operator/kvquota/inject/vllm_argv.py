"""The vLLM command line of a container: recognise it and edit it in place.

Kubernetes runs `command + args` (the image's entrypoint when `command` is absent). A
chart may put vLLM's flags in either list or split them across both, so every edit
works on the joined argv and writes each token back to the list it came from; new
flags go at the end of `args`, which is the end of the argv in every form.

No vLLM import: the operator's image has no vLLM. The flags edited here all take a
value, which is what the scanner needs to know (`--flag value` or `--flag=value`,
underscores or dashes, as vLLM's FlexibleArgumentParser accepts).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PORT = 8000  # vLLM's --port default
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_PYTHON = "python3"
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
# Flags that take a value (the ones read or rewritten here, and the TLS pair refused).
_VALUED = frozenset({"port", "host", "scheduler-cls", "scheduling-policy", "ssl-certfile",
                     "ssl-keyfile", "uds", "api-key", "served-model-name"})


class NotVllm(ValueError):
    """The container does not start vLLM's OpenAI server in a form we can edit."""


@dataclass
class Flag:
    name: str  # normalised: dashes, no leading --
    at: int  # index of the flag token in the joined argv
    value: str | None
    value_at: int | None  # index of a separate value token; None for --flag=value


@dataclass
class VllmCommand:
    """A container's joined argv, where each token lives, and what was changed."""

    container: dict[str, Any]
    argv: list[str]
    entry: int  # tokens that start the program (`vllm serve`: 2)
    in_command: int  # tokens of argv that come from `command`
    appended: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, container: dict[str, Any]) -> VllmCommand:
        command = [str(t) for t in container.get("command") or []]
        args = [str(t) for t in container.get("args") or []]
        argv = command + args
        return cls(container, argv, _entry_length(container, command, argv), len(command))

    def flags(self) -> list[Flag]:
        found: list[Flag] = []
        i = self.entry
        while i < len(self.argv):
            token = self.argv[i]
            if token == "--":
                break
            if token.startswith("--"):
                name, eq, inline = token[2:].partition("=")
                name = name.replace("_", "-")
                if eq:
                    found.append(Flag(name, i, inline, None))
                elif name in _VALUED and i + 1 < len(self.argv):
                    found.append(Flag(name, i, self.argv[i + 1], i + 1))
                    i += 1
                else:
                    found.append(Flag(name, i, None, None))
            i += 1
        return found

    def find(self, name: str) -> list[Flag]:
        return [f for f in self.flags() if f.name == name]

    def set_value(self, flag: Flag, value: str) -> None:
        if flag.value_at is None:
            self.argv[flag.at] = f"--{flag.name}={value}"
        else:
            self.argv[flag.value_at] = value

    def replace_token(self, at: int, token: str) -> None:
        self.argv[at] = token

    def append(self, *tokens: str) -> None:
        self.appended.extend(tokens)

    def write_back(self) -> None:
        """Store the edited argv in the container's `command` and `args`."""
        command, args = self.argv[:self.in_command], self.argv[self.in_command:]
        if "command" in self.container:
            self.container["command"] = command
        args = args + self.appended
        if args or "args" in self.container:
            self.container["args"] = args
        self.appended = []

    @property
    def full_argv(self) -> list[str]:
        return self.argv + self.appended

    def python(self) -> str:
        """The Python interpreter that runs vLLM in the image: the one the command names
        (`python3.12 -m ...`, `/opt/venv/bin/python -m ...`), the one beside a `vllm`
        script named by its path, else `python3` (what vLLM's images put on PATH)."""
        if self.entry and self.in_command:
            program = self.argv[0]
            if _PYTHON.fullmatch(os.path.basename(program)):
                return program
            if os.path.basename(program) == "vllm" and "/" in program:
                return f"{os.path.dirname(program)}/python3"
        return DEFAULT_PYTHON

    def server_argv(self) -> list[str]:
        """The arguments vLLM's own parser sees (after `vllm serve` / `-m module`)."""
        return self.full_argv[self.entry:]


def _entry_length(container: dict[str, Any], command: list[str], argv: list[str]) -> int:
    if not command:
        image = str(container.get("image", "")).rsplit("/", 1)[-1]
        if "vllm" in image.split(":", 1)[0] or _serves(argv, 0):
            return 0  # the image's entrypoint is vLLM's server; args are its flags
        raise NotVllm("its image is not a vLLM image and it has no command")
    n = _serves(argv, 0)
    if n:
        return n
    program = os.path.basename(command[0])
    if program in _SHELLS and "-c" in command:
        raise NotVllm("it starts vLLM through a shell script (`sh -c`); put vLLM's command "
                      "line in `command`/`args` so its flags can be edited")
    raise NotVllm("its command does not start vLLM's OpenAI server (`vllm serve` or "
                  f"`python -m {SERVER_MODULE}`)")


def _serves(argv: list[str], start: int) -> int:
    """How many tokens from `start` start vLLM's server; 0 if they do not."""
    if len(argv) <= start:
        return 0
    program = os.path.basename(argv[start])
    if program == "vllm" and argv[start + 1:start + 2] == ["serve"]:
        return 2
    if _PYTHON.fullmatch(program):
        rest = argv[start + 1:]
        # python [-u|-O|...] -m vllm.entrypoints.openai.api_server
        for i, token in enumerate(rest):
            if token == "-m":
                return 3 + i if rest[i + 1:i + 2] == [SERVER_MODULE] else 0
            if not token.startswith("-"):
                return 0
    return 0


def unwrap_shell(container: dict[str, Any]) -> str | None:
    """Turn `sh -c "<one vLLM command line>"` into the exec form, in place; what was done,
    or None when the container does not start through a shell.

    vLLM's own Kubernetes guide starts the server this way. A script that is one simple
    command needs no shell, and only the exec form can be edited token by token. A
    script the shell does more with (expansions, several commands, redirections) is
    refused: rewriting it would change what it does.
    """
    argv = [str(t) for t in (container.get("command") or []) + (container.get("args") or [])]
    if len(argv) < 3 or os.path.basename(argv[0]) not in _SHELLS or argv[1] != "-c":
        return None
    script = argv[2]
    shell_work = ("$" in script or "`" in script or "\n" in script.strip() or argv[3:])
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes
        tokens = []
    if shell_work or not tokens or any(set(t) <= set("();<>|&") for t in tokens):
        raise NotVllm("it starts vLLM through a shell script that does more than run one "
                      "command (expansions, several commands or redirections); put vLLM's "
                      "command line in `command`/`args` so its flags can be edited")
    if tokens[0] == "exec":
        tokens = tokens[1:]
    entry = _serves(tokens, 0)
    if not entry:
        raise NotVllm("its shell script does not start vLLM's OpenAI server (`vllm serve` "
                      f"or `python -m {SERVER_MODULE}`)")
    container["command"], container["args"] = tokens[:entry], tokens[entry:]
    return f"{argv[0]} -c '<vLLM command line>' -> exec form (the same command, no shell)"
