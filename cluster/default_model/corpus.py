"""The default model's training text: documentation that ships with every Python.

Two sources, both read from the running interpreter's standard library so that no download
is ever needed:

1. ``pydoc_data.topics``: the language reference's topics (what ``help("def")`` prints),
   about half a megabyte of English prose on Python.
2. The docstrings (module, class and function) of the standard library's ``.py`` files,
   found with :func:`ast.get_docstring`, so no module is imported or executed.

Only prose is kept (see :func:`prose`): grammar rules, tables, doctests and code blocks are
dropped, and each paragraph is unwrapped onto one line, because a model of a few million
parameters trained for minutes learns far more readable English from sentences than it can
learn from layout. Everything is visited in sorted order, so the same Python version always
yields the same documents in the same order, byte for byte.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

# Folders of the standard library whose docstrings are not worth learning from: test suites
# (full of deliberately odd text), vendored or legacy packages, and installed third-party code.
_SKIPPED_DIRS = frozenset(
    {
        "__pycache__",
        "distutils",
        "ensurepip",
        "idle_test",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "turtledemo",
    }
)

# Docstrings shorter than this are mostly one-liners such as "Return self." that teach the
# model little besides repetition.
_MIN_DOCSTRING_CHARS = 80

_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

# A paragraph with any of these at the start of a line is code, grammar or a table.
_NOT_PROSE_PREFIXES = (">>>", "...", "+-", "|", "$ ", "%", "::")
_MIN_LETTER_RATIO = 0.75  # of non-space characters; lower is code, tables or rulers
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _is_prose(lines: list[str]) -> bool:
    if not lines or any(line.startswith(_NOT_PROSE_PREFIXES) or "::=" in line for line in lines):
        return False
    # Indented by more than the paragraph's first line: a code block or a table.
    if any(line[:1].isspace() for line in lines):
        return False
    chars = [c for line in lines for c in line if not c.isspace()]
    return bool(chars) and sum(c.isalpha() for c in chars) / len(chars) >= _MIN_LETTER_RATIO


def prose(text: str) -> str:
    """The prose paragraphs of ``text``, each unwrapped onto one line, separated by blank lines."""
    kept = []
    for block in _PARAGRAPH_BREAK.split(text):
        lines = textwrap.dedent(block).strip("\n").splitlines()
        if _is_prose(lines):
            kept.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(kept)


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def topic_documents() -> list[str]:
    """The language reference topics, sorted by topic name; empty if pydoc_data is absent."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [doc for doc in (prose(topics[name]) for name in sorted(topics)) if doc]


def _stdlib_sources(root: Path) -> list[Path]:
    sources = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        sources.append(path)
    # Sort on the relative path as text, which does not depend on the filesystem's order.
    return sorted(sources, key=lambda p: p.relative_to(root).as_posix())


def docstring_documents(root: Path | None = None) -> Iterator[str]:
    """Docstrings of the standard library, file by file in sorted order.

    Within a file, :func:`ast.walk` visits nodes in a fixed breadth-first order.
    """
    root = stdlib_dir() if root is None else root
    for path in _stdlib_sources(root):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. SyntaxWarning on odd escapes
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED_NODES):
                doc = ast.get_docstring(node)
                text = prose(doc) if doc else ""
                if len(text) >= _MIN_DOCSTRING_CHARS:
                    yield text


def gather_corpus(max_bytes: int | None = None) -> list[str]:
    """All training documents in their fixed order, optionally cut to ``max_bytes`` of UTF-8.

    The cut keeps whole documents and shortens the last one (at a character boundary), so a
    small slice is always a prefix of the full corpus.
    """
    docs: list[str] = []
    total = 0

    def sources() -> Iterator[str]:
        yield from topic_documents()
        yield from docstring_documents()

    for doc in sources():
        size = len(doc.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            rest = doc.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")
            if rest:
                docs.append(rest)
            break
        docs.append(doc)
        total += size
    if not docs:
        raise RuntimeError(
            f"no training text found: neither pydoc_data.topics nor docstrings under {stdlib_dir()}"
        )
    return docs


def corpus_fingerprint(docs: list[str]) -> str:
    """A SHA-256 over the documents and their boundaries, to record what a model was built from."""
    digest = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()
