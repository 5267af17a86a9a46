"""Real clients as their users drive them, pointed at cacheproxy: LangChain's ChatOpenAI with
bound tools, instructor's default (TOOLS) mode, and the `llm` CLI with a tool function."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import instructor
import openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conftest import ProxyFactory

MODEL = "cacheproxy-demo"


@tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return "sunny, 21 degrees"


class Animal(BaseModel):
    """The schema instructor's tests here extract: the demo model was trained on schemas of
    an animal's name and facts (name, color, food, home, habit), in the schema's order."""

    name: str
    food: str


async def test_langchain_bind_tools_returns_the_call_and_repeats_are_hits(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    chat = ChatOpenAI(model=MODEL, base_url=proxy.url + "/v1", api_key="unused",
                      max_retries=0).bind_tools([get_weather])
    first = await chat.ainvoke("What is the weather in Paris?")
    generated = proxy.generations
    again = await chat.ainvoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in first.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert again.tool_calls == first.tool_calls  # ids included: the same answer
    assert proxy.generations == generated  # the repeat was a HIT


async def test_instructor_tools_mode_gets_a_valid_object(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    client = instructor.from_openai(
        openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0),
        mode=instructor.Mode.TOOLS)
    animal = await client.chat.completions.create(
        model=MODEL, response_model=Animal, max_retries=0,
        messages=[{"role": "user", "content": "Tell me about the fox."}])
    assert isinstance(animal, Animal)  # the call's arguments are held to the schema
    assert animal.name == "fox"  # and sensible: the animal asked about
    generated = proxy.generations
    again = await client.chat.completions.create(
        model=MODEL, response_model=Animal, max_retries=0,
        messages=[{"role": "user", "content": "Tell me about the fox."}])
    # (model_dump: instructor attaches the raw response, whose id differs, to the object.)
    assert again.model_dump() == animal.model_dump() and proxy.generations == generated


def _llm(user_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    llm = Path(sys.executable).with_name("llm")
    return subprocess.run([str(llm), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LLM_USER_PATH": str(user_dir)})


FUNCTIONS = '''
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return "rainy, 12 degrees"
'''


async def test_llm_cli_runs_a_tool_chain_and_a_second_run_is_all_hits(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await make_proxy()
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: demo\n  model_name: {MODEL}\n  api_base: {proxy.url}/v1\n"
        "  supports_tools: true\n")
    args = ("-m", "demo", "--functions", FUNCTIONS, "--td", "What is the weather in London?")
    first = await asyncio.to_thread(_llm, tmp_path, *args)
    assert first.returncode == 0, first.stderr
    assert re.search(r"Tool call: get_weather\(\{'city': '\w+'\}\)", first.stderr), first.stderr
    assert first.stdout.strip()  # the answer after the tool's result
    generated = proxy.generations
    second = await asyncio.to_thread(_llm, tmp_path, *args)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert proxy.generations == generated  # the call and the answer were both HITs
    logged = json.loads(_llm(tmp_path, "logs", "--json", "-n", "1").stdout)
    assert logged and logged[0]["model"] == "demo"
