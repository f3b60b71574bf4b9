"""A user's own tools for the server's --tool flag (tests/test_service.py, tests/test_rollout.py):

python server.py --tool wordcount=tests.my_tools:word_count --tool slow=tests.my_tools:slow
"""

import asyncio
import sys
import time


def word_count(text: str) -> str:
    """The number of words in `text`."""
    return str(len(text.split()))


def reverse(text: str) -> str:
    return text[::-1]


def shout(text: str) -> str:
    return text.upper() + "!"


def plus(a: int, b: int = 0) -> str:
    """a + b: a tool of keyword arguments, called with a JSON object."""
    return str(a + b)


async def slow(seconds: str) -> str:
    """Answer after `seconds` seconds (to test tool timeouts): an async tool, awaited."""
    await asyncio.sleep(float(seconds))
    return "done"


# -- misbehaving tools, which the server must survive (tests/test_rollout.py) ----------------------
def hang(seconds: str) -> str:
    """A plain tool that does not return for a long time (beyond any tool timeout)."""
    time.sleep(600)
    return "woke up"


def exits(code: str) -> str:
    """A plain tool that calls exit(): SystemExit."""
    sys.exit(int(code))


async def leak(text: str) -> str:
    """An async tool that lets a CancelledError of its own escape, as one awaiting a task that
    someone else cancelled does."""
    raise asyncio.CancelledError()


def big(words: str) -> str:
    """An answer of `words` words: far more tokens than an episode's budget."""
    return "word " * int(words)
