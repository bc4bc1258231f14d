"""Built-in prompts, shared by training (`augury train-draft`) and the benchmarks (`augury bench
--prompts chat`): question templates over topics we ship, never a hub dataset.

Sources: Python standard-library module names (with their `pydoc.synopsis` one-liner where
the module is pure Python), everyday topics, pairs to compare and small coding tasks, each
crossed with explain / list / how-to / compare / write templates. A prompt's split is a
hash of its text, so evaluation prompts never leak into training whatever the count asked;
the benchmarks draw from the same held-out ('eval') split.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import pydoc
import random
import sys
from dataclasses import dataclass
from pathlib import Path

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "rainbows", "the moon's phases", "tides",
    "black holes", "the solar system", "gravity", "magnetism", "electricity", "batteries", "solar panels",
    "wind turbines", "nuclear power", "climate change", "recycling", "composting", "bees", "coral reefs",
    "rainforests", "deserts", "glaciers", "the human heart", "the immune system", "vaccines", "sleep",
    "dreams", "memory", "habits", "meditation", "exercise", "stretching", "running a marathon", "yoga",
    "healthy breakfast ideas", "drinking water", "vitamins", "cooking rice", "baking bread", "making pasta",
    "brewing coffee", "making tea", "a vegetable garden", "houseplants", "keeping a goldfish", "training a dog",
    "caring for a cat", "bird watching", "camping", "hiking safety", "packing for a trip", "learning a language",
    "public speaking", "job interviews", "writing a resume", "saving money", "budgeting", "compound interest",
    "inflation", "the stock market", "credit cards", "taxes", "renting an apartment", "buying a used car",
    "bicycles", "airplanes", "trains", "electric cars", "traffic lights", "bridges", "skyscrapers", "elevators",
    "refrigerators", "microwave ovens", "the internet", "email", "passwords", "encryption", "Wi-Fi", "GPS",
    "smartphones", "computer memory", "operating systems", "compilers", "databases", "cloud computing",
    "machine learning", "neural networks", "robots", "3D printing", "video games", "chess", "football",
    "basketball", "the Olympic Games", "music theory", "learning the guitar", "painting with watercolors",
    "photography", "writing a short story", "poetry", "libraries", "the printing press", "ancient Egypt",
    "the Roman Empire", "the Renaissance", "the Industrial Revolution", "democracy", "the United Nations",
    "time zones", "calendars", "maps", "the periodic table", "atoms", "DNA", "evolution", "dinosaurs",
    "the ocean", "clouds", "snow", "thunderstorms", "hurricanes", "friendship", "teamwork", "time management",
    "procrastination", "note taking", "studying for exams", "reading more books", "moving to a new city",
    "planning a birthday party", "writing a thank-you note", "first aid", "fire safety", "the common cold",
)

TOPIC_TEMPLATES = (
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "How would you explain {t} to a ten-year-old?",
    "List five key points about {t}.", "What are the most common misconceptions about {t}?",
    "Summarize the basics of {t} in a few sentences.", "Why does {t} matter?",
    "Give me some practical tips related to {t}.", "Write a short poem about {t}.",
    "What questions should a beginner ask about {t}?",
)

COMPARE_TEMPLATES = ("Compare {a} and {b}.", "What is the difference between {a} and {b}?")

CODING_TASKS = (
    "reverse a string", "check whether a number is prime", "compute the factorial of n", "sort a list of numbers",
    "find the largest element in a list", "count the words in a sentence", "check whether a string is a palindrome",
    "compute Fibonacci numbers", "remove duplicates from a list", "merge two sorted lists", "read a text file",
    "write data to a CSV file", "parse a JSON string", "compute the average of a list", "binary search a sorted list",
    "convert Celsius to Fahrenheit", "count the vowels in a string", "flatten a nested list",
    "find the greatest common divisor of two numbers", "generate a random password", "validate an email address",
    "implement a stack", "implement a queue", "compute the sum of digits of a number", "transpose a matrix",
    "check whether two strings are anagrams", "find the second smallest number in a list",
    "capitalize the first letter of every word", "convert a decimal number to binary", "rotate a list by k places",
)
LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "Java")
CODING_TEMPLATES = (
    "Write a {lang} function to {task}.", "How do I {task} in {lang}?",
    "Show a short {lang} example that shows how to {task}, and explain it.",
)
MODULE_TEMPLATES = (
    "What is the Python {m} module used for?", "Show a short example of using Python's {m} module.",
    "Explain the main functions of the Python {m} module.",
)
MODULE_SYNOPSIS_TEMPLATE = "The Python standard library describes the {m} module as: \"{s}\" Explain what that means with an example."


# A varied held-out set, by kind: written for evaluation only (no template above produces these,
# and training never reads them), so acceptance measured on it is not memorisation of the
# training templates. `augury bench --prompts varied` and `augury train-draft` report per kind.
VARIED_PROMPTS: dict[str, tuple[str, ...]] = {
    "code-python": (
        "Write a Python class for a bank account with deposit, withdraw and a balance that can never go negative.",
        "My Python script prints 'None' after the list. Why?\n\ndef show(xs):\n    for x in xs:\n        print(x)\n\nprint(show([1, 2]))",
        "Use a Python dictionary comprehension to map each word in a sentence to its length.",
        "Write a pytest test for a function slugify(title) that lowercases and replaces spaces with dashes.",
        "How do I read a large log file line by line in Python and count lines containing ERROR?",
        "Write a Python generator that yields the running total of a list of numbers.",
    ),
    "code-other": (
        "Write a TypeScript interface for a blog post with a title, tags and an optional publish date.",
        "In Go, how do I start three goroutines and wait for all of them to finish?",
        "Write a C function that swaps two integers through pointers, and a main that calls it.",
        "Show a Rust enum for traffic light colors and a match that returns how long each one lasts.",
        "Write a Makefile rule that compiles main.c into an executable called app.",
        "Write a small HTML page with a button that shows an alert saying hello when clicked.",
    ),
    "sql-shell": (
        "Write an SQL query that returns the five customers with the highest total order amount.",
        "Write SQL to create a table of books with an id, a title, an author and a year, then insert two rows.",
        "What does this SQL do? SELECT department, COUNT(*) FROM employees GROUP BY department HAVING COUNT(*) > 10;",
        "Give me a shell command that finds every .txt file under the current folder modified in the last day.",
        "How do I see which process is listening on port 8080 on Linux?",
        "Write a git command sequence to create a new branch, commit one file and push it.",
    ),
    "math": (
        "A train travels 180 km in 2 hours and 15 minutes. What is its average speed in km per hour?",
        "If I save 35 dollars a week, how many weeks until I have 1000 dollars? Show the steps.",
        "Solve for x: 3x + 7 = 25. Explain each step.",
        "A rectangle is twice as long as it is wide and its perimeter is 48 cm. What are its sides?",
        "What is 15 percent of 240, and how do you work it out in your head?",
        "Three friends share a 54 dollar bill, but one of them pays double the others. How much does each pay?",
    ),
    "recipe-howto": (
        "Give me a simple recipe for pancakes for two people.",
        "How do I make a vegetable soup with what is usually left in the fridge?",
        "What are the steps to change a flat bicycle tire?",
        "How do I clean a cast iron pan without ruining it?",
        "Write a packing checklist for a weekend at the beach.",
        "How should I prepare for my first five kilometre run?",
    ),
    "creative": (
        "Write a haiku about a cup of coffee on a rainy morning.",
        "Write a limerick about a cat who wants to be a programmer.",
        "Write the opening paragraph of a mystery story set in a lighthouse.",
        "Write a short, funny product description for a pair of socks that never get lost.",
        "Write a four-line poem for a friend's birthday card.",
        "Describe an autumn forest to someone who has never seen one, in one paragraph.",
    ),
    "rewrite-summarize": (
        "Summarize in two sentences: The city council met on Tuesday to discuss the new bike lanes. "
        "Supporters said the lanes would make streets safer and reduce traffic, while some shop owners worried "
        "about losing parking spaces. The council agreed to test the lanes on two streets for six months.",
        "Rewrite this email to sound more polite: Send me the report today. I already asked twice.",
        "Make this sentence shorter and clearer: Due to the fact that it was raining, we made the decision to "
        "stay inside for the duration of the afternoon.",
        "Turn these notes into a short paragraph: meeting moved to Friday; bring laptops; lunch provided; "
        "room 204.",
        "Fix the grammar: Me and him goes to the store yesterday and buyed three apple.",
        "Translate to simple English for a child: Photosynthesis converts light energy into chemical energy.",
    ),
    "data-format": (
        "Convert this to JSON: name Alice, age 30, languages English and Spanish.",
        "Turn this CSV into a Markdown table:\nfruit,color,price\napple,red,1.2\nbanana,yellow,0.5",
        "Write a YAML config for a web server with a host, a port and a list of allowed origins.",
        "Give me a regular expression that matches a date like 2024-03-15, and explain each part.",
        "Write an example JSON response for an API that lists two users with ids and emails.",
        "Explain the difference between JSON and XML with a small example of the same data in both.",
    ),
    "advice-explain": (
        "I keep waking up at 3 am. What could help me sleep through the night?",
        "How do I politely tell a coworker that they talk too loudly on calls?",
        "Why is the sky blue but sunsets are red?",
        "What should I check before signing a lease for an apartment?",
        "How does a refrigerator keep food cold?",
        "What is the difference between weather and climate?",
    ),
    "copy-quote": (
        "Repeat this list back to me in alphabetical order: pear, apple, mango, cherry, banana, kiwi.",
        "Here is a sentence: 'The quick brown fox jumps over the lazy dog.' Write it again with every word "
        "capitalized.",
        "Correct the spelling but keep everything else the same: I recieved the pakage on wensday and it "
        "was definately broken.",
        "Add line numbers to this poem:\nRoses are red\nViolets are blue\nSugar is sweet\nAnd so are you",
        "Convert this Python 2 code to Python 3: print 'Total:', total",
        "Rename the variable x to count in this code:\nx = 0\nfor item in items:\n    x += 1\nprint(x)",
    ),
}


def varied_prompts(count: int | None = None) -> list[tuple[str, str]]:
    """(kind, prompt) from VARIED_PROMPTS, kinds taken in turn, so any count spans the kinds."""
    kinds = list(VARIED_PROMPTS)
    width = max(len(v) for v in VARIED_PROMPTS.values())
    out = [(k, VARIED_PROMPTS[k][i]) for i in range(width) for k in kinds if i < len(VARIED_PROMPTS[k])]
    return out if count is None else out[:count]


@dataclass(frozen=True)
class Prompt:
    """One user message; `ids` is set instead of `text` for token-id prompts (no tokenizer)."""

    text: str | None
    ids: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return self.text if self.text is not None else " ".join(map(str, self.ids or ()))


def stdlib_modules() -> list[tuple[str, str | None]]:
    """(module name, synopsis or None) for public top-level standard-library modules."""
    out = []
    for name in sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n != "antigravity"):
        synopsis = None
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                synopsis = (pydoc.synopsis(spec.origin) or "").strip() or None
        except (ImportError, ValueError, OSError, SyntaxError):
            pass
        out.append((name, synopsis))
    return out


def builtin_prompts() -> list[str]:
    """Every distinct built-in prompt, in a fixed order (a few thousand)."""
    out = [tpl.format(t=t) for t in TOPICS for tpl in TOPIC_TEMPLATES]
    rng = random.Random(1234)
    for _ in range(200):
        a, b = rng.sample(TOPICS, 2)
        out.append(rng.choice(COMPARE_TEMPLATES).format(a=a, b=b))
    out += [tpl.format(lang=lang, task=task) for task in CODING_TASKS for lang in LANGUAGES for tpl in CODING_TEMPLATES]
    for name, synopsis in stdlib_modules():
        out += [tpl.format(m=name) for tpl in MODULE_TEMPLATES]
        if synopsis and len(synopsis) < 200:
            out.append(MODULE_SYNOPSIS_TEMPLATE.format(m=name, s=synopsis.rstrip(".")  + "."))
    return list(dict.fromkeys(out))  # distinct, order kept


def read_prompts_file(path: Path) -> list[Prompt]:
    """JSON lines: {"text": "..."} (a user message) or {"ids": [...]} (raw token ids)."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if isinstance(rec.get("text"), str):
            prompts.append(Prompt(rec["text"]))
        elif isinstance(rec.get("ids"), list) and rec["ids"] and all(isinstance(i, int) for i in rec["ids"]):
            prompts.append(Prompt(None, tuple(rec["ids"])))
        else:
            raise ValueError(f"{path}:{n}: each line needs a string 'text' or a non-empty int list 'ids'")
    return list({p.key: p for p in prompts}.values())


EVAL_PERCENT = 5  # share of prompts held out for evaluation (and benchmarks), by hash
VALID_PERCENT = 3  # share held out for validation during training


def split_of(prompt: Prompt, eval_percent: int = EVAL_PERCENT, valid_percent: int = VALID_PERCENT) -> str:
    """'eval', 'valid' or 'train' from a stable hash of the prompt (independent of order and count)."""
    bucket = int(hashlib.sha256(prompt.key.encode()).hexdigest()[:8], 16) % 100
    if bucket < eval_percent:
        return "eval"
    return "valid" if bucket < eval_percent + valid_percent else "train"


def held_out_prompts(count: int) -> list[str]:
    """The first `count` built-in prompts of the 'eval' split, which training never sees."""
    return [t for t in builtin_prompts() if split_of(Prompt(t)) == "eval"][:count]


def make_splits(prompts: list[Prompt], num_train: int, seed: int, eval_percent: int = EVAL_PERCENT,
                valid_percent: int = VALID_PERCENT) -> dict[str, list[Prompt]]:
    """Shuffle deterministically, split by hash, cap train at num_train (valid scaled alike)."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    splits: dict[str, list[Prompt]] = {"train": [], "valid": [], "eval": []}
    for p in order:
        splits[split_of(p, eval_percent, valid_percent)].append(p)
    splits["train"] = splits["train"][:num_train]
    splits["valid"] = splits["valid"][: max(1, num_train * valid_percent // 100)]
    return splits
