"""A user's own tools for the server's --tool flag (tests/test_service.py, tests/test_rollout.py):

python server.py --tool wordcount=tests.my_tools:word_count --tool slow=tests.my_tools:slow
"""

import asyncio


def word_count(text: str) -> str:
    """The number of words in `text`."""
    return str(len(text.split()))


def reverse(text: str) -> str:
    return text[::-1]


def shout(text: str) -> str:
    return text.upper() + "!"


async def slow(seconds: str) -> str:
    """Answer after `seconds` seconds (to test tool timeouts): an async tool, awaited."""
    await asyncio.sleep(float(seconds))
    return "done"
