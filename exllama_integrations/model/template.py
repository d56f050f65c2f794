"""Chat templates rendered in a sandbox that bounds what they may reach and how much work they may do.

A model directory is untrusted input, and so is its chat template. jinja2's immutable sandbox stops
escapes (attribute access to internals, mutating the messages); it does not stop work. This
environment adds budgets, each failing with :class:`~exllama_integrations.errors.ChatTemplateError`:

* time: a render may take ``TIME_BUDGET`` seconds (checked at every loop step, call, attribute and
  operator);
* steps: at most ``MAX_STEPS`` loop iterations, calls and lookups per render (nested ``range()`` loops);
* size: no string or list over ``MAX_STRING`` items is built by ``*``, ``+``, ``~``, ``%``, ``format``,
  ``join``, ``replace``, padding filters, ``batch``, ``slice`` or ``tojson``, whether a width is written in the
  format or given as an argument (``'%*s' % (n, x)``, ``'{:>{}}'.format(x, n)``); the output is at most
  ``MAX_OUTPUT`` characters;
* an allow-list: only the globals and filters below are there (jinja's ``lipsum`` is not: it loops in Python
  for as long as asked), each filter that can grow its output in a bounded version;
* constant folding: the operators above are intercepted, so ``{{ 'a' * 10**10 }}`` is not evaluated
  while the template compiles.
"""

from __future__ import annotations

import json
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

from jinja2 import nodes, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ..errors import ChatTemplateError

TIME_BUDGET = 5.0
MAX_STEPS = 2_000_000
MAX_STRING = 16_000_000
MAX_OUTPUT = 64_000_000
MAX_RANGE = 100_000
MAX_INDENT = 64

_state = threading.local()
_WIDTH = re.compile(r"%[-+ #0]*(\d+)|\{[^{}]*:[^{}]*?(\d{4,})")


class _Budget:
    def __init__(self) -> None:
        self.deadline = time.perf_counter() + TIME_BUDGET
        self.steps = 0

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise ChatTemplateError(f"the chat template took more than {MAX_STEPS} steps to render; refusing it.")
        if time.perf_counter() > self.deadline:
            raise ChatTemplateError(f"the chat template took more than {TIME_BUDGET:g} s to render; refusing it.")


def _tick(n: int = 1) -> None:
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is not None:
        budget.tick(n)


def _size(n: int, what: str) -> None:
    if n > MAX_STRING:
        raise ChatTemplateError(f"the chat template built {what} of {n} items (more than {MAX_STRING}); refusing it.")


def _len(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _check_widths(fmt: str) -> None:
    for m in _WIDTH.finditer(fmt):
        width = int(m.group(1) or m.group(2))
        _size(width, "a padded string")


_DYNAMIC_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(?:\*|\d*\.\*)")
_BIG_DIGITS = re.compile(r"\d{9,}")


def _arguments(args: Any) -> list[Any]:
    if isinstance(args, (tuple, list)):
        return list(args)
    if isinstance(args, Mapping):
        return list(args.values())
    return [args]


def _check_dynamic_widths(fmt: str, args: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """Widths and precisions given as arguments (``%*s``, ``{:{}}``) are sizes too: each one is checked."""
    dynamic = bool(_DYNAMIC_PERCENT.search(fmt))
    if not dynamic and "{" in fmt:
        try:
            dynamic = any(spec and "{" in spec for _, _, spec, _ in string.Formatter().parse(fmt))
        except (ValueError, IndexError):
            return  # not a format string str.format accepts: it will fail on its own
    if not dynamic:
        return
    for value in [*_arguments(args), *(kwargs or {}).values()]:
        if isinstance(value, int) and not isinstance(value, bool):
            _size(abs(value), "a padded string")
        elif isinstance(value, str) and _BIG_DIGITS.search(value):
            _size(int(_BIG_DIGITS.search(value).group()), "a padded string")  # type: ignore[union-attr]


class _Bounded(ImmutableSandboxedEnvironment):
    """The immutable sandbox with work budgets (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _size(len(seq) * max(times, 0), "a repeated sequence")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > 4096:
                raise ChatTemplateError("the chat template computes an integer power too large; refusing it.")
        elif operator == "+":
            _size(_len(left) + _len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_widths(left)
            _check_dynamic_widths(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _tick()
        name = getattr(__obj, "__name__", "")
        # the sandbox hands ``str.format`` back wrapped; the bound method (and so its string) is under __wrapped__
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
                _size(args[0], "a padded string")
            elif name == "expandtabs":
                _size(len(owner) * (int(args[0]) if args and isinstance(args[0], int) else 8), "a string")
            elif name in ("format", "format_map"):
                _check_widths(owner)
                _check_dynamic_widths(owner, args[0] if name == "format_map" and args else args, kwargs)
            elif name == "replace" and len(args) >= 2:
                _size(_replaced_size(owner, str(args[0]), str(args[1])), "a replaced string")
            elif name == "join" and args:
                items = list(_limited(args[0]))
                _size(sum(map(_len, items)) + len(owner) * len(items), "a joined string")
                return super().call(__context, __obj, items, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_widths(obj)  # the sandbox hands back its own formatter, so check the widths here
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


def _replaced_size(s: str, old: str, new: str) -> int:
    count = len(s) + 1 if old == "" else s.count(old)
    return len(s) + count * (len(new) - len(old))


def _limited(items: Iterable[Any]) -> Iterator[Any]:
    """Iterate, one budget step per item."""
    for n, item in enumerate(items):
        _tick()
        if n >= MAX_STRING:
            _size(n + 1, "a sequence")
        yield item


class _BoundedCodegen(CodeGenerator):
    """Routes ``~`` concatenation through a size check."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.globals['__concat__']((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LoopBudget(NodeTransformer):
    """Every ``{% for %}`` iterates through the step budget."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("__loop__", "load"), [node.iter], [], None, None)
        return node


def _concat(items: tuple[Any, ...]) -> str:
    _tick()
    parts = [str(x) for x in items]
    _size(sum(map(len, parts)), "a concatenation")
    return "".join(parts)


def _bounded_join(parts: Iterable[str]) -> str:
    items = list(parts)
    _size(sum(map(len, items)), "a block of output")
    return "".join(items)


def _range(*args: int) -> range:
    _tick()
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"the chat template asks for range() of {len(r)} items (at most {MAX_RANGE}).")
    return r  # loops over it are budgeted (every for loop is)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    if indent is not None and (not isinstance(indent, int) or indent > MAX_INDENT):
        raise ChatTemplateError(f"the chat template asks tojson for an indent of {indent!r} (at most {MAX_INDENT}).")
    if separators is not None and sum(len(str(s)) for s in separators) > MAX_INDENT:
        raise ChatTemplateError("the chat template asks tojson for oversized separators.")
    out = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    _size(len(out), "a JSON string")
    return out


def _lines(value: Any) -> int:
    return str(value).count("\n") + 1


def _filters(env: _Bounded) -> dict[str, Callable[..., Any]]:
    """Jinja's filters that can grow their output, with a size check in front of each."""
    f = dict(env.filters)

    def center(value: Any, width: int = 80) -> str:
        _size(width if isinstance(width, int) else 0, "a padded string")
        return str(f["center"](value, width))

    def indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
        pad = width if isinstance(width, int) else len(str(width))
        _size(len(str(s)) + pad * _lines(s), "an indented string")
        return str(f["indent"](s, width, first, blank))

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_widths(str(value))
        _check_dynamic_widths(str(value), args, kwargs)
        return str(f["format"](value, *args, **kwargs))

    def batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
        if not isinstance(linecount, int) or not 1 <= linecount <= MAX_RANGE:
            raise ChatTemplateError(
                f"the chat template asks batch for {linecount!r} items a batch (at most {MAX_RANGE})."
            )
        return f["batch"](list(_limited(value)), linecount, fill_with)

    def slice_(value: Any, slices: int, fill_with: Any = None) -> Any:
        if not isinstance(slices, int) or not 1 <= slices <= MAX_RANGE:
            raise ChatTemplateError(f"the chat template asks slice for {slices!r} slices (at most {MAX_RANGE}).")
        return f["slice"](list(_limited(value)), slices, fill_with)

    @pass_eval_context
    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> Any:
        _size(_replaced_size(str(s), str(old), str(new)), "a replaced string")
        return f["replace"](eval_ctx, s, old, new, count)

    @pass_eval_context
    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
        items = list(_limited(value))
        _size(sum(len(str(x)) for x in items) + len(str(d)) * len(items), "a joined string")
        return f["join"](eval_ctx, items, d, attribute)

    @pass_environment
    def wordwrap(
        environment: Any,
        s: Any,
        width: int = 79,
        break_long_words: bool = True,
        wrapstring: Any = None,
        break_on_hyphens: bool = True,
    ) -> Any:
        _size(len(str(s)) * (1 + len(str(wrapstring or "\n"))), "a wrapped string")
        return f["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    bounded = {
        "center": center,
        "indent": indent,
        "format": format_,
        "batch": batch,
        "slice": slice_,
        "replace": replace,
        "join": join,
        "wordwrap": wordwrap,
        "tojson": _tojson,
    }
    return {**{name: f[name] for name in SAFE_FILTERS}, **bounded}


SAFE_FILTERS = frozenset(
    "abs attr capitalize count d default dictsort e escape first float forceescape groupby int items last length "
    "list lower map max min reject rejectattr reverse round safe select selectattr sort string striptags sum title "
    "trim truncate unique upper urlencode wordcount xmlattr".split()
)
"""jinja's filters that cannot grow their output past their input (the allow-list; the others are bounded)."""


SAFE_GLOBALS = frozenset({"cycler", "dict", "joiner", "namespace"})
"""jinja's default globals kept (``range`` is replaced by a bounded one; ``lipsum`` is gone)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _environment() -> _Bounded:
    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.code_generator_class = _BoundedCodegen
    env.concat = _bounded_join  # type: ignore[method-assign]  # set blocks and macros join their output here
    env.filters = _filters(env)  # type: ignore[assignment]  # the allow-list replaces jinja's defaults
    env.globals = {k: v for k, v in env.globals.items() if k in SAFE_GLOBALS}  # type: ignore[assignment]
    env.globals.update(
        raise_exception=_raise,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        range=_range,
        __loop__=_limited,
        __concat__=_concat,
    )
    return env


class ChatTemplate:
    r"""A compiled chat template. ``render`` applies every budget; errors are :class:`ChatTemplateError`.

    Example:
        >>> t = ChatTemplate("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}")
        >>> t.render(messages=[{"role": "user", "content": "hi"}])
        '[user] hi\\n'
    """

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            tree = _LoopBudget().visit(env.parse(source))
            self._template = env.from_string(tree)
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        except (RecursionError, MemoryError) as e:
            raise ChatTemplateError(
                f"the chat template is too large or nested to compile ({type(e).__name__})."
            ) from None
        self.source = source

    def render(self, **context: Any) -> str:
        """Render with ``context`` (messages, tools, add_generation_prompt, special tokens, ...)."""
        _state.budget = _Budget()
        try:
            out: list[str] = []
            total = 0
            for piece in self._template.generate(**context):
                total += len(piece)
                if total > MAX_OUTPUT:
                    raise ChatTemplateError(f"the chat template rendered more than {MAX_OUTPUT} characters.")
                out.append(piece)
                _tick()
            return "".join(out)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None
        except Exception as e:  # noqa: BLE001 - a model's template is untrusted input; never let it escape raw
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
        finally:
            _state.budget = None


def render_messages(template: ChatTemplate, messages: Iterable[Mapping[str, Any]], **context: Any) -> str:
    """Render copies of ``messages`` (the sandbox is immutable, but callers' dicts are never handed in)."""
    return template.render(messages=[dict(m) for m in messages], **context)
