"""Reading bash the way bash reads it, without running anything: statements and expansions.

``split_statements`` cuts a script into statements (quotes, ``\\``-newline continuations, comments,
``;``/``&&``/``||``/``|``, multi-line ``( ... )`` and ``$( ... )``, here-documents skipped). ``Expander``
replaces ``$VAR``, ``${VAR:-default}`` (and ``:=``, ``:+``, ``:?``, ``#``, ``%``), ``${ARR[@]}``, ``$((...))``
and positional parameters with their values, re-quoted so ``shlex.split`` then gives the words bash
would; command substitutions are not run (they stay as one placeholder word) and every such case is
reported in ``problems``.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Optional

NAME = r"[A-Za-z_][A-Za-z0-9_]*"


# ------------------------------------------------------------------------------------------ statements
@dataclass
class Statement:
    line: int
    text: str


def split_statements(text: str) -> tuple[list[Statement], list[tuple[int, str]]]:
    """Cut a script into statements (bash's rules for quotes, continuations, comments, separators and
    here-documents). Returns the statements and ``(line, reason)`` problems (unterminated quotes)."""
    text = text.replace("\r\n", "\n")
    out: list[Statement] = []
    problems: list[tuple[int, str]] = []
    buf: list[str] = []
    line = start = 1
    i, n = 0, len(text)
    depth = 0  # ( ... ) and $( ... )
    quote: Optional[str] = None
    heredocs: list[tuple[str, bool]] = []

    def flush() -> None:
        nonlocal buf, start
        stmt = "".join(buf).strip()
        if stmt:
            out.append(Statement(start, stmt))
        buf = []
        start = line

    while i < n:
        c = text[i]
        if quote and c == "\n":  # a newline inside quotes belongs to the word
            line += 1
            buf.append(c)
        elif quote == "'":
            buf.append(c)
            if c == "'":
                quote = None
        elif c == "\\" and quote != "'":
            if i + 1 < n and text[i + 1] == "\n":  # continuation: both characters vanish
                i += 2
                line += 1
                continue
            buf.append(text[i:i + 2])
            i += 2
            continue
        elif quote in ('"', "`"):
            buf.append(c)
            if c == quote:
                quote = None
        elif c in "'\"`":
            quote = c
            buf.append(c)
        elif c == "#" and (not buf or buf[-1][-1:].isspace() or buf[-1][-1:] in ";&|("):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c == "(":
            depth += 1
            buf.append(c)
        elif c == ")" and depth:
            depth -= 1
            buf.append(c)
        elif c == "<" and text.startswith("<<", i) and not text.startswith("<<<", i) and depth == 0:
            m = re.match(r"<<(-?)\s*(['\"]?)(\w+)\2", text[i:])
            if m:
                heredocs.append((m.group(3), bool(m.group(1))))
                buf.append(m.group(0))
                i += len(m.group(0))
                continue
            buf.append(c)
        elif c == "\n" and depth == 0:
            line += 1
            flush()
            while heredocs:  # skip the bodies of here-documents started on this line
                delim, strip = heredocs.pop(0)
                while i + 1 < n:
                    end = text.find("\n", i + 1)
                    end = n if end < 0 else end
                    body = text[i + 1:end]
                    i = end
                    line += 1
                    if (body.strip() if strip else body) == delim:
                        break
                start = line
        elif c == "\n":
            line += 1
            buf.append(" ")
        elif depth == 0 and c in ";&|":
            two = text[i:i + 2]
            if c == "&" and (buf and buf[-1][-1:] in "<>" or text[i + 1:i + 2] == ">"):
                buf.append(c)  # a redirection such as 2>&1 or &>log
            elif two == ";;":
                flush()
                i += 2
                continue
            else:
                flush()
                i += 2 if two in ("&&", "||") else 1
                continue
        else:
            buf.append(c)
        i += 1
    if quote:
        problems.append((start, f"unterminated {quote} quote"))
    flush()
    return out, problems


# ------------------------------------------------------------------------------------------ expansion
_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
              ast.RShift: operator.rshift}


def _arith(expr: str, lookup) -> int:
    """bash ``$(( ... ))``: integers, + - * / % **, parentheses, variables with or without ``$``."""
    expr = re.sub(rf"\$\{{?({NAME})\}}?", r"\1", expr)

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            value = lookup(node.id)
            return int(value) if value not in (None, "") else 0
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError(ast.dump(node))

    return ev(ast.parse(expr.strip(), mode="eval"))


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one opened just before ``i`` (quotes respected), or -1."""
    depth, quote = 1, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _escape(value: str, in_double: bool) -> str:
    """Re-quote an expanded value so ``shlex`` reads it back literally (words still split when unquoted)."""
    if in_double:  # shlex only honours \\ and \" inside double quotes
        return re.sub(r'([\\"])', r"\\\1", value)
    return re.sub(r"([\\'\"$`;&|<>()#])", r"\\\1", value)


class Expander:
    """Expands ``$VAR``/``${...}``/``$((...))`` in one statement with the script's variables so far."""

    def __init__(self, variables: dict[str, Any], env: Mapping[str, str], positional: list[str], script: str):
        self.variables = variables
        self.env = env
        self.positional = positional
        self.script = script
        self.problems: list[str] = []

    def lookup(self, name: str) -> Optional[str]:
        value = self.variables.get(name)
        if isinstance(value, list):
            return value[0] if value else ""
        if value is not None:
            return str(value)
        return self.env.get(name)

    def _param(self, body: str) -> tuple[Any, bool]:
        """Value of ``${body}``; the bool says whether it is a whole array (``${A[@]}``)."""
        m = re.fullmatch(rf"#({NAME})", body)
        if m:
            return str(len(self.lookup(m.group(1)) or "")), False
        m = re.fullmatch(rf"({NAME})\[([@*])\]", body)
        if m:
            value = self.variables.get(m.group(1))
            if value is None:
                self._undefined(m.group(1))
                return [], True
            return (value if isinstance(value, list) else [str(value)]), True
        m = re.fullmatch(rf"({NAME})\[(\d+)\]", body)
        if m:
            value = self.variables.get(m.group(1))
            items = value if isinstance(value, list) else [value] if value is not None else []
            idx = int(m.group(2))
            return (str(items[idx]) if idx < len(items) else ""), False
        m = re.fullmatch(rf"({NAME}|\d+)(:?)([-=+?])(.*)", body, re.DOTALL)
        if m:
            name, colon, op, word = m.groups()
            value = self._simple(name, warn=False)
            unset = value is None or (colon and value == "")
            word = self.expand_word(word)
            if op in "-=":
                if unset and op == "=":
                    self.variables[name] = word
                return (word if unset else value), False
            if op == "+":
                return ("" if unset else word), False
            if unset:
                self.problems.append(f"${{{body}}}: {name} is not set (bash would stop here)")
            return value or "", False
        m = re.fullmatch(rf"({NAME})(%%?|##?)(.*)", body)
        if m:
            value = self._simple(m.group(1)) or ""
            pattern = re.escape(m.group(3)).replace(r"\*", ".*").replace(r"\?", ".")
            greedy = len(m.group(2)) == 2
            if m.group(2).startswith("%"):
                mm = re.match(rf"(.*{'?' if greedy else ''})({pattern})$", value, re.DOTALL)
                return (mm.group(1) if mm else value), False
            mm = re.match(rf"({pattern}{'' if greedy else '?'})(.*)$", value, re.DOTALL) if pattern else None
            return (mm.group(2) if mm else value), False
        if re.fullmatch(rf"{NAME}|\d+|[@*#?$!]", body):
            return (self._simple(body) or ""), False
        self.problems.append(f"${{{body}}} is not a supported expansion (left as written)")
        return f"${{{body}}}", False

    def _simple(self, name: str, warn: bool = True) -> Optional[str]:
        if name.isdigit() or name in "@*":
            if name == "0":
                return self.script
            idx = int(name) - 1 if name.isdigit() else None
            if idx is None:
                return " ".join(self.positional)
            if idx < len(self.positional):
                return self.positional[idx]
            if warn:
                self.problems.append(f"${name}: a script argument that is not known here (left as ${name})")
            return f"${name}" if warn else None
        if name in "#?$!":
            return str(len(self.positional)) if name == "#" else ""
        value = self.lookup(name)
        if value is None and warn:
            self._undefined(name)
            return f"${name}"
        return value

    def _undefined(self, name: str) -> None:
        self.problems.append(f"${name} is not set in the script or the environment (left as ${name})")

    def _unevaluated(self, text: str, in_double: bool) -> str:
        """A command substitution is not run: it stays as one word, ``$(hostname...)``."""
        self.problems.append(f"command substitution {text} is not run (kept as a placeholder)")
        words = text.strip("$()`").split()
        placeholder = f"$({words[0] if words else ''}{'...' if len(words) > 1 else ''})"
        return _escape(placeholder, in_double)

    def expand_word(self, text: str) -> str:
        """Expand a word outside any statement context (a default value, an array element)."""
        expanded = self.expand(text)
        try:
            parts = shlex.split(expanded)
        except ValueError:
            return expanded
        return " ".join(parts)

    def expand(self, text: str) -> str:
        """The statement with every expansion replaced by its (re-quoted) value, ready for ``shlex``."""
        out: list[str] = []
        i, n = 0, len(text)
        quote: Optional[str] = None
        while i < n:
            c = text[i]
            if quote == "'":
                out.append(c)
                if c == "'":
                    quote = None
                i += 1
                continue
            if c == "\\" and i + 1 < n:
                out.append(text[i:i + 2])
                i += 2
                continue
            if c == "'" and quote is None:
                quote = "'"
                out.append(c)
                i += 1
                continue
            if c == '"':
                quote = None if quote == '"' else '"'
                out.append(c)
                i += 1
                continue
            if c == "`":
                end = text.find("`", i + 1)
                end = n - 1 if end < 0 else end
                out.append(self._unevaluated(text[i:end + 1], quote == '"'))
                i = end + 1
                continue
            if c != "$" or i + 1 >= n:
                out.append(c)
                i += 1
                continue
            in_double = quote == '"'
            nxt = text[i + 1]
            if text.startswith("$((", i):
                end = _matching(text, i + 3, "(", ")")
                if end > 0 and end + 1 < n and text[end + 1] == ")":
                    expr = text[i + 3:end]
                    try:
                        out.append(str(_arith(self.expand_word(expr), self.lookup)))
                    except (ValueError, SyntaxError, TypeError, ZeroDivisionError, RecursionError):
                        self.problems.append(f"arithmetic $(({expr})) could not be evaluated (left as written)")
                        out.append(_escape(text[i:end + 2], in_double))
                    i = end + 2
                    continue
            if nxt == "(":
                end = _matching(text, i + 2, "(", ")")
                end = n - 1 if end < 0 else end
                out.append(self._unevaluated(text[i:end + 1], in_double))
                i = end + 1
                continue
            if nxt == "{":
                end = _matching(text, i + 2, "{", "}")
                if end < 0:
                    out.append(c)
                    i += 1
                    continue
                value, is_array = self._param(text[i + 2:end])
                i = end + 1
            else:
                m = re.match(rf"{NAME}|\d|[@*#?$!]", text[i + 1:])
                if not m:
                    out.append(c)
                    i += 1
                    continue
                name = m.group(0)
                is_array = name == "@" and in_double
                value = self.positional if is_array else self._simple(name)
                i += 1 + len(name)
            if is_array and in_double:  # "${A[@]}": one word per element
                out.append('"' + " ".join(shlex.quote(str(v)) for v in value) + '"' if value else '""')
            elif is_array:
                out.append(" ".join(_escape(str(v), False) for v in value))
            else:
                out.append(_escape(str(value if value is not None else ""), in_double))
        return "".join(out)
