"""doctor's built-in prompts: short, varied (code and prose), so a run needs no data file.

Interleaved code / prose so that the two halves doctor compares for noise (even / odd prompts) hold the same mix.
"""

BUILTIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Explain in a few sentences why the sky is blue.",
    "import json\n\n\ndef load_config(path):\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "What are the main differences between a list and a tuple in Python?",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "Give three tips for writing clear technical documentation.",
    "import os\nimport sys\n\n\ndef main(argv):\n    if len(argv) < 2:\n",
    "Summarize the plot of a heist movie in one paragraph.",
    "def parse_args():\n    import argparse\n\n    parser = argparse.ArgumentParser(",
    "List the steps to make a cup of tea.",
]
