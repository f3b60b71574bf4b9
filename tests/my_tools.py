"""A user's own tool for the server's --tool flag (tests/test_service.py):

python server.py --tool wordcount=tests.my_tools:word_count
"""


def word_count(text: str) -> str:
    """The number of words in `text`."""
    return str(len(text.split()))
