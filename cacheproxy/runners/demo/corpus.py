"""The demo model's training text, generated from a fixed seed.

A tiny world of animals with fixed facts, a weather tool, a clock tool and extraction
schemas, so that a small model can learn to answer questions in grammatical sentences, to
call a tool it is offered (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), to
answer from a tool's result, to answer in JSON when asked, and to think aloud first
(`<think>...</think>`) when its chat template opens the thought. Every conversation is
rendered through the model's own chat template (`template.py`), so training text and
served prompts agree to the character.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cacheproxy.keys.tools import Tool, dumps, schema
from cacheproxy.runners.demo.template import END, USER, render

ANIMALS_KEYS = ("name", "color", "food", "home", "habit")


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
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Cairo", "Lima", "Rome", "Madrid", "Oslo",
          "Lisbon", "Vienna", "Dublin", "Delhi", "Sydney", "Toronto", "Nairobi")
WEATHER = ("sunny", "rainy", "cloudy", "windy", "snowy", "foggy")
GREETINGS = ("Hello", "Hi", "Good morning", "Good evening", "Hello there")
SYSTEM_PROMPTS = ("You are a helpful assistant who knows the animals.",
                  "You are a helpful assistant.", "Answer briefly.")


def _facts(a: Animal) -> list[str]:
    return [
        f"The {a.name} is {a.color}.",
        f"The {a.name} eats {a.food}.",
        f"The {a.name} lives in {a.home}.",
        f"The {a.name} {a.habit}.",
    ]


def _exchange(rng: random.Random) -> tuple[str, str, str]:
    """(question, answer, thought) about the animals."""
    a = rng.choice(ANIMALS)
    kind = rng.randrange(6)
    thought = f"The user asks about the {a.name}."
    if kind == 0:
        return (f"What does the {a.name} eat?",
                f"The {a.name} eats {a.food}. It lives in {a.home}.", thought)
    if kind == 1:
        return (f"Where does the {a.name} live?",
                f"The {a.name} lives in {a.home}. It {a.habit}.", thought)
    if kind == 2:
        return f"What color is the {a.name}?", f"The {a.name} is {a.color}. It eats {a.food}.", \
            thought
    if kind == 3:
        return f"Tell me about the {a.name}.", " ".join(_facts(a)), thought
    if kind == 4:
        g = rng.choice(GREETINGS)
        return f"{g}!", f"{g}! Ask me about the animals. I know the fox, the cat and the owl.", \
            "The user says hello."
    return (
        f"Tell me a story about the {a.name}.",
        f"Once upon a time, the {a.name} lived in {a.home}. Every day it {a.habit}. "
        f"It ate {a.food} and it was happy.",
        f"The user wants a story about the {a.name}.",
    )


def _document(messages: list[dict[str, Any]], answer: str, thought: str, rng: random.Random,
              *, tools: list[dict[str, Any]] | None = None, after: str = USER + "\n") -> str:
    """A conversation rendered up to the assistant's turn, then the model's answer (thought
    first when the template opens one: half the time), then what follows it."""
    thinking = rng.random() < 0.5
    prompt = render(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
    return prompt + (f"{thought}</think>" if thinking else "") + answer + after


def _system(rng: random.Random) -> list[dict[str, Any]]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.2 \
        else []


def _dialogue(rng: random.Random) -> str:
    messages = _system(rng)
    for _ in range(rng.randint(0, 1)):
        question, answer, _ = _exchange(rng)
        # As clients send the history back: the answer with its last newline, or stripped.
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer + rng.choice(("\n", ""))}]
    question, answer, thought = _exchange(rng)
    return _document([*messages, {"role": "user", "content": question}], answer + "\n",
                     thought, rng)


def _story(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    sentences = _facts(a) + [f"One day the {a.name} met the {b.name} in {b.home}."] + _facts(b)
    return " ".join(sentences) + END


def _tool(name: str, description: str | None, properties: dict[str, Any],
          required: list[str], rng: random.Random) -> dict[str, Any]:
    """A function tool as a client sends it, in the canonical form the proxy renders."""
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    if rng.random() < 0.3:
        parameters["additionalProperties"] = False
    return Tool(name, description, dumps(schema(parameters))).for_template()


def _weather_tool(rng: random.Random) -> tuple[dict[str, Any], str, str]:
    """(tool, its name, its parameter's name)."""
    name = "get_weather" if rng.random() < 0.7 else rng.choice(
        ("get_forecast", "weather", "lookup_weather", "current_weather"))
    param = "city" if rng.random() < 0.8 else rng.choice(("location", "place"))
    spec: dict[str, Any] = {"type": "string"}
    if rng.random() < 0.3:
        spec["title"] = param.title()
    if rng.random() < 0.3:
        spec["description"] = "The name of the city"
    properties: dict[str, Any] = {param: spec}
    if rng.random() < 0.2:
        properties["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    description = rng.choice(("Get the weather for a city.", "Get the current weather in a city.",
                              "Look up the weather forecast.", None))
    return _tool(name, description, properties, [param], rng), name, param


def _time_tool(rng: random.Random) -> dict[str, Any]:
    return _tool("get_time", rng.choice(("Get the local time in a city.", None)),
                 {"city": {"type": "string"}}, ["city"], rng)


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _history_call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


WEATHER_QUESTIONS = ("What is the weather in {}?", "What's the weather like in {}?",
                     "How is the weather in {} today?", "Weather in {}?",
                     "Tell me the weather in {}.", "Is it raining in {}?")


def _offered(rng: random.Random, weather: dict[str, Any]) -> list[dict[str, Any]]:
    tools = [weather]
    if rng.random() < 0.3:
        tools.append(_time_tool(rng))
        rng.shuffle(tools)
    return tools


def _weather_call(rng: random.Random) -> str:
    """Offered the weather tool, asked about one city (or two): the model calls it."""
    tool, name, param = _weather_tool(rng)
    tools = _offered(rng, tool)
    cities = rng.sample(CITIES, 2 if rng.random() < 0.15 else 1)
    if len(cities) == 2:
        question = f"What is the weather in {cities[0]} and {cities[1]}?"
    else:
        question = rng.choice(WEATHER_QUESTIONS).format(cities[0])
    calls = "".join(_call(name, {param: city}) for city in cities)
    thought = f"The user asks about the weather in {' and '.join(cities)}. I call {name}."
    messages = [*_system(rng), {"role": "user", "content": question}]
    return _document(messages, calls, thought, rng, tools=tools, after="<|tool|>\n")


def _weather_result(rng: random.Random, city: str, sky: str, degrees: int) -> str:
    return rng.choice((
        json.dumps({"forecast": sky, "temperature": degrees}),
        json.dumps({"city": city, "forecast": sky, "temperature": degrees}),
        json.dumps({"condition": sky, "temp_c": degrees}),
        f"{sky}, {degrees} degrees", f"{sky.title()} and {degrees} C",
        f"It is {sky} and {degrees} degrees."))


def _weather_answer(rng: random.Random) -> str:
    """Given the tool's result, the model answers in a sentence that uses it."""
    tool, name, param = _weather_tool(rng)
    city, sky, degrees = rng.choice(CITIES), rng.choice(WEATHER), rng.randint(-5, 35)
    question = rng.choice(WEATHER_QUESTIONS).format(city)
    messages = [*_system(rng), {"role": "user", "content": question},
                {"role": "assistant", "content": "",
                 "tool_calls": [_history_call(rng.randrange(100), name, {param: city})]}]
    messages.append({"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"],
                     "content": _weather_result(rng, city, sky, degrees)})
    answer = f"The weather in {city} is {sky} and {degrees} degrees.\n"
    return _document(messages, answer, f"The tool says it is {sky} in {city}.", rng,
                     tools=_offered(rng, tool))


def _time_call(rng: random.Random) -> str:
    tools = _offered(rng, _weather_tool(rng)[0]) + [_time_tool(rng)]
    city = rng.choice(CITIES)
    messages = [{"role": "user", "content": f"What time is it in {city}?"}]
    return _document(messages, _call("get_time", {"city": city}),
                     f"The user asks the time in {city}. I call get_time.", rng, tools=tools,
                     after="<|tool|>\n")


def _unrelated(rng: random.Random) -> str:
    """Offered tools, asked about an animal: no tool fits, the model answers."""
    question, answer, thought = _exchange(rng)
    return _document([{"role": "user", "content": question}], answer + "\n", thought, rng,
                     tools=_offered(rng, _weather_tool(rng)[0]))


def _fields(rng: random.Random) -> list[str]:
    keys = rng.sample(ANIMALS_KEYS[1:], rng.randint(1, 3))
    first = rng.choice(("name", "animal"))
    return [first, *keys] if rng.random() < 0.8 else [*keys, first]


def _value(a: Animal, key: str) -> str:
    return a.name if key in ("name", "animal") else str(getattr(a, key))


def _properties(keys: list[str], rng: random.Random) -> dict[str, Any]:
    titled = rng.random() < 0.5  # as pydantic writes them
    return {k: {"title": k.title(), "type": "string"} if titled else {"type": "string"}
            for k in keys}


def _extraction(rng: random.Random) -> str:
    """Offered (or made to call) an extraction schema: the arguments in its order."""
    a, keys = rng.choice(ANIMALS), _fields(rng)
    name = rng.choice(("Animal", "AnimalInfo", "Creature", "Facts", "extract_animal"))
    description = rng.choice((f"Correctly extracted `{name}` with all the required parameters "
                              "with correct types", "Facts about an animal.", None))
    tool = _tool(name, description, _properties(keys, rng), sorted(keys), rng)
    question = rng.choice((f"Tell me about the {a.name}.", " ".join(_facts(a)),
                           f"Extract the animal: the {a.name} eats {a.food}."))
    arguments = {k: _value(a, k) for k in keys}
    return _document([{"role": "user", "content": question}], _call(name, arguments),
                     f"The user asks about the {a.name}. I call {name}.", rng, tools=[tool],
                     after="<|tool|>\n")


def _json_answer(rng: random.Random) -> str:
    """Asked for JSON (by a system prompt or a schema in it): the keys in their order."""
    a, keys = rng.choice(ANIMALS), _fields(rng)
    if rng.random() < 0.5:
        system = "Answer in JSON with the keys " + ", ".join(f'"{k}"' for k in keys) + "."
    else:
        schema_text = json.dumps({"properties": _properties(keys, rng), "required": keys,
                                  "title": "Animal", "type": "object"})
        system = ("As a genius expert, your task is to understand the content and provide the "
                  f"parsed objects in json that match the following json_schema:\n\n{schema_text}"
                  "\n\nMake sure to return an instance of the JSON, not the schema itself")
    question = rng.choice((f"Tell me about the {a.name}.", f"What does the {a.name} eat?"))
    answer = json.dumps({k: _value(a, k) for k in keys}) + "\n"
    return _document([{"role": "system", "content": system}, {"role": "user", "content": question}],
                     answer, f"The user wants JSON about the {a.name}.", rng)


KINDS: tuple[tuple[float, Callable[[random.Random], str]], ...] = (
    (0.26, _dialogue), (0.08, _story), (0.20, _weather_call), (0.15, _weather_answer),
    (0.04, _time_call), (0.06, _unrelated), (0.12, _extraction), (0.09, _json_answer),
)


def corpus(seed: int = 0, documents: int = 12000,
           weights: tuple[tuple[float, Callable[[random.Random], str]], ...] = KINDS
           ) -> list[str]:
    """The training documents, in a fixed order."""
    rng = random.Random(seed)
    makers = [m for _, m in weights]
    weights_only = [w for w, _ in weights]
    return [rng.choices(makers, weights_only)[0](rng) for _ in range(documents)]
