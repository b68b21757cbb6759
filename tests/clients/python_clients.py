"""langchain-openai and litellm against dg serve: tools, structured output (both LangChain methods),
the legacy completions batch, the Responses API. Prints one JSON object of what each got; the
Python test checks it. Runs in a venv of its own (`make test-clients`), not dg's.
Usage: python python_clients.py TOOLS_URL DEMO_URL GEMMA_URL (each .../v1)"""

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch a price list at import

from pydantic import BaseModel, Field  # noqa: E402

tools_url, demo_url, gemma_url = sys.argv[1:4]
out = {}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Weather(BaseModel):
    """The weather in a city"""

    location: str
    days: int = Field(ge=1, le=3)


def get_weather(location: str, days: int) -> str:
    """The weather in a city"""
    return "sunny"


def get_time() -> str:
    """The time"""
    return "noon"


from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402

caller = ChatOpenAI(model="caller", base_url=tools_url, api_key="unused", max_retries=0)
message = caller.bind_tools([get_weather, get_time]).invoke("weather?", seed=0)
out["langchain_tools"] = [[c["name"], c["args"]] for c in message.tool_calls]
chunks = list(caller.bind_tools([get_weather, get_time]).stream("weather?", seed=0))
whole = chunks[0]
for chunk in chunks[1:]:
    whole += chunk
out["langchain_tools_streamed"] = [[c["name"], c["args"]] for c in whole.tool_calls]

demo = ChatOpenAI(model="demo", base_url=demo_url, api_key="unused", max_retries=0, max_tokens=80)
person = demo.with_structured_output(Person, method="json_schema").invoke("a person")
out["langchain_json_schema"] = person.model_dump()
gemma = ChatOpenAI(model="tiny", base_url=gemma_url, api_key="unused", max_retries=0, max_tokens=120)
weather = gemma.with_structured_output(Weather, method="function_calling").invoke("weather in Paris?")
out["langchain_function_calling"] = weather.model_dump()
legacy = OpenAI(model="demo", base_url=demo_url, api_key="unused", max_retries=0, max_tokens=32, batch_size=4,
                model_kwargs={"seed": 0})
generated = legacy.generate(["<|turn>user\nreverse: AB<turn|>\n<|turn>model\n",
                             "<|turn>user\nsort: DCBA<turn|>\n<|turn>model\n"])
out["langchain_legacy_batch"] = [g[0].text for g in generated.generations]
responses = ChatOpenAI(model="demo", base_url=demo_url, api_key="unused", max_retries=0, use_responses_api=True)
out["langchain_responses"] = responses.invoke("reverse: HELLO").text()

import litellm  # noqa: E402

r = litellm.completion(model="openai/caller", api_base=tools_url, api_key="unused", messages=[
    {"role": "user", "content": "weather?"}], tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": Weather.model_json_schema()}}], seed=0)
out["litellm_tools"] = [[c.function.name, json.loads(c.function.arguments)] for c in r.choices[0].message.tool_calls]
r = litellm.completion(model="openai/demo", api_base=demo_url, api_key="unused", max_tokens=80,
                       messages=[{"role": "user", "content": "a person"}], response_format=Person)
out["litellm_json_schema"] = json.loads(r.choices[0].message.content)
r = litellm.completion(model="openai/demo", api_base=demo_url, api_key="unused", seed=0,
                       messages=[{"role": "user", "content": "reverse: HELLO"}], stream=True)
out["litellm_stream"] = "".join(c.choices[0].delta.content or "" for c in r)
r = litellm.responses(model="openai/demo", api_base=demo_url, api_key="unused", input="reverse: HELLO", seed=0)
out["litellm_responses"] = r.output[-1].content[0].text
print(json.dumps(out))
