// The official Node openai client against dg serve: tools (whole and streamed), structured output,
// responses, several prompts. Prints one JSON object of what it got; the Python test checks it.
// Usage: node node_openai.mjs TOOLS_URL DEMO_URL (both .../v1)
import OpenAI from "openai";

const [toolsUrl, demoUrl] = process.argv.slice(2);
const tools = [{ type: "function", function: { name: "get_weather", description: "The weather",
  parameters: { type: "object", properties: { location: { type: "string" }, days: { type: "integer" } },
                required: ["location", "days"] } } },
  { type: "function", function: { name: "get_time", description: "The time", parameters: { type: "object", properties: {} } } }];
const out = {};
const caller = new OpenAI({ baseURL: toolsUrl, apiKey: "unused", maxRetries: 0 });
const r = await caller.chat.completions.create({ model: "caller", messages: [{ role: "user", content: "weather?" }], tools, seed: 0 });
out.calls = r.choices[0].message.tool_calls.map((c) => [c.function.name, JSON.parse(c.function.arguments)]);
out.finish = r.choices[0].finish_reason;
const stream = await caller.chat.completions.create({ model: "caller", messages: [{ role: "user", content: "weather?" }],
  tools, seed: 0, stream: true });
const streamed = {};
for await (const chunk of stream) {
  for (const tc of chunk.choices[0]?.delta?.tool_calls ?? []) {
    streamed[tc.index] ??= { name: "", arguments: "" };
    streamed[tc.index].name += tc.function?.name ?? "";
    streamed[tc.index].arguments += tc.function?.arguments ?? "";
  }
}
out.streamed = Object.values(streamed).map((c) => [c.name, JSON.parse(c.arguments)]);
const demo = new OpenAI({ baseURL: demoUrl, apiKey: "unused", maxRetries: 0 });
const json = await demo.chat.completions.create({ model: "demo", messages: [{ role: "user", content: "a person" }],
  max_tokens: 80, response_format: { type: "json_schema", json_schema: { name: "p", schema: { type: "object",
    properties: { name: { type: "string" }, age: { type: "integer", minimum: 0, maximum: 120 } }, required: ["name", "age"] } } } });
out.structured = JSON.parse(json.choices[0].message.content);
out.decoder = json.dg.decoder;
const resp = await demo.responses.create({ model: "demo", input: "reverse: HELLO", seed: 0 });
out.responses = resp.output_text;
const batch = await demo.completions.create({ model: "demo", prompt: ["<|turn>user\nreverse: AB<turn|>\n<|turn>model\n",
  "<|turn>user\nsort: DCBA<turn|>\n<|turn>model\n"], seed: 0, max_tokens: 32 });
out.batch = batch.choices.map((c) => [c.index, c.text]);
console.log(JSON.stringify(out));
