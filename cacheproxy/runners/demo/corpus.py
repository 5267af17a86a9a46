"""The demo model's training text, generated from a fixed seed.

A tiny world of animals with fixed facts, so that a 1 M-parameter model can
learn to answer questions about it in grammatical sentences.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (END, SYSTEM, USER, ASSISTANT)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Animal:
    """One creature of the demo world and its facts."""

    name: str
    color: str
    food: str
    home: str
    habit: str


ANIMALS = (
    Animal("fox", "red", "berries", "the forest", "runs at night"),
    Animal("cat", "black", "fish", "the house", "sleeps in the sun"),
    Animal("dog", "brown", "bones", "the farm", "plays with the children"),
    Animal("owl", "grey", "mice", "the old tree", "watches the moon"),
    Animal("bear", "brown", "honey", "the mountain", "sleeps all winter"),
    Animal("duck", "white", "bread", "the pond", "swims in the rain"),
    Animal("horse", "white", "apples", "the field", "runs by the river"),
    Animal("rabbit", "grey", "carrots", "the garden", "hides under the bush"),
    Animal("frog", "green", "flies", "the pond", "sings in the evening"),
    Animal("mouse", "small and grey", "cheese", "the barn", "hides in the wall"),
    Animal("bird", "blue", "seeds", "the tall tree", "sings in the morning"),
    Animal("wolf", "grey", "meat", "the hills", "howls at the moon"),
)

GREETINGS = ("Hello", "Hi", "Good morning", "Good evening", "Hello there")


def _facts(a: Animal) -> list[str]:
    return [
        f"The {a.name} is {a.color}.",
        f"The {a.name} eats {a.food}.",
        f"The {a.name} lives in {a.home}.",
        f"The {a.name} {a.habit}.",
    ]


def _exchange(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(ANIMALS)
    kind = rng.randrange(6)
    if kind == 0:
        return f"What does the {a.name} eat?", f"The {a.name} eats {a.food}. It lives in {a.home}."
    if kind == 1:
        return f"Where does the {a.name} live?", f"The {a.name} lives in {a.home}. It {a.habit}."
    if kind == 2:
        return f"What color is the {a.name}?", f"The {a.name} is {a.color}. It eats {a.food}."
    if kind == 3:
        return f"Tell me about the {a.name}.", " ".join(_facts(a))
    if kind == 4:
        g = rng.choice(GREETINGS)
        return f"{g}!", f"{g}! Ask me about the animals. I know the fox, the cat and the owl."
    return (
        f"Tell me a story about the {a.name}.",
        f"Once upon a time, the {a.name} lived in {a.home}. Every day it {a.habit}. "
        f"It ate {a.food} and it was happy.",
    )


def _dialogue(rng: random.Random) -> str:
    parts = []
    if rng.random() < 0.2:
        parts.append(f"{SYSTEM}\nYou are a helpful assistant who knows the animals.\n")
    for _ in range(rng.randint(1, 3)):
        question, answer = _exchange(rng)
        parts.append(f"{USER}\n{question}\n{ASSISTANT}\n{answer}\n")
    return "".join(parts) + USER + "\n"


def _story(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    sentences = _facts(a) + [f"One day the {a.name} met the {b.name} in {b.home}."] + _facts(b)
    return " ".join(sentences) + END


def corpus(seed: int = 0, documents: int = 6000) -> list[str]:
    """The training documents: chat dialogues and plain stories, in a fixed order."""
    rng = random.Random(seed)
    return [_dialogue(rng) if rng.random() < 0.7 else _story(rng) for _ in range(documents)]
