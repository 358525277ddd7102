"""`kvpersist completion bash|zsh`: a completion script written from the parser itself, so a
command or flag added to the CLI completes without anyone editing a script."""

from __future__ import annotations

import argparse
import shlex


def commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each subcommand and its option strings (the long and short spellings), in parser order."""
    return {name: [o for a in sub._actions for o in a.option_strings]
            for action in parser._actions if isinstance(action, argparse._SubParsersAction)  # no public walk of them
            for name, sub in action.choices.items()}


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """A bash completion function for the parser's program (zsh: through bashcompinit)."""
    prog = parser.prog
    table = commands(parser)
    func = "_" + prog.replace("-", "_") + "_complete"
    cases = "\n".join(f"    {shlex.quote(name)}) opts={shlex.quote(' '.join(opts))} ;;" for name, opts in table.items())
    body = f"""{func}() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" cmd="" opts="" i
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "${{COMP_WORDS[i]}}" in -*) ;; *) cmd="${{COMP_WORDS[i]}}"; break ;; esac
  done
  if [ -z "$cmd" ]; then
    COMPREPLY=($(compgen -W {shlex.quote(' '.join(table))} -- "$cur"))
    return
  fi
  case "$cmd" in
{cases}
  esac
  COMPREPLY=($(compgen -W "$opts" -- "$cur"))
}}
complete -o default -F {func} {prog}
"""
    return ("autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else "") + body
