"""Tool calling in chat completions: what `tools` / `tool_choice` / `parallel_tool_calls` mean for
one request, how tool turns reach the chat template, and how the answer becomes `tool_calls`.

- The template renders tools itself when it knows them (Llama 3.1, Qwen2.5, Mistral...); for one
  that does not (SmolLM2), the functions and the parser's call format go in a system message, and
  past calls and results are written in that format, so nothing the client sent is dropped.
- "auto": the model may call; its text is parsed. "none": tools are shown, the text is content.
  "required" / a named function: a grammar from the functions' JSON schemas (the structured-output
  backend) forces one call, or several if parallel_tool_calls, so the arguments always parse
  and validate.
- parallel_tool_calls=false: one call at most. "auto" answers keep the first call the model wrote
  (the others are not reported); "required" and named choices cannot write a second one."""

from __future__ import annotations

import dataclasses
import json

from paxpage.server.errors import bad_request
from paxpage.server.protocol import ChatCompletionRequest, ChatMessage
from paxpage.server.tool_parsers import ParsedCall, ToolParser, template_renders_tools
from paxpage.structured import StructuredOutputs


@dataclasses.dataclass(frozen=True)
class ToolRendering:
    """How this model's template meets tools: chosen once per server."""

    parser: ToolParser | None  # None: the template's tool format is one no parser reads
    template_renders_tools: bool
    # the parser's markers that are single added tokens here, by id: the grammar names the token
    # (llguidance never spells an added token out of its text)
    marker_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    keep_special_tokens: bool = False  # a marker is a special token: keep it in the text for the parser


def rendering_for(tokenizer, parser_name: str | None) -> ToolRendering:
    from paxpage.server.tool_parsers import choose

    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    template = template if isinstance(template, str) else None
    parser = choose(template, parser_name)
    ids, keep = {}, False
    if parser is not None and tokenizer is not None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        for text in parser.token_markers:
            token_id = tokenizer.convert_tokens_to_ids(text)
            token = added.get(token_id)
            if token is not None and str(token) == text:
                ids[text], keep = token_id, keep or token.special
    return ToolRendering(parser, template_renders_tools(template), ids, keep)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """One request's tools: what the template gets, how the answer is read."""

    rendering: ToolRendering
    tools: list[dict] | None  # OpenAI tool dicts, as HF chat templates take them
    parse: bool  # read tool calls out of the answer ("auto", "required", named)
    constraint: StructuredOutputs | None  # "required" / named: the grammar of the calls
    parallel: bool

    @property
    def parser(self) -> ToolParser:
        return self.rendering.parser

    @property
    def harmony_calls(self) -> bool:
        """The answer's harmony messages to functions are read as calls: a harmony reasoning
        parser passes them on whole (server/reasoning.py, keep_calls)."""
        return self.parse and self.parser.harmony


def plan_tools(req: ChatCompletionRequest, rendering: ToolRendering) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs a non-empty tools list", "tool_choice")
        return ToolPlan(rendering, None, False, None, req.parallel_tool_calls)
    names = [t.function.name for t in req.tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad_request(f"tools define function(s) {dup} more than once", "tools")
    if rendering.parser is None:
        raise bad_request("this model's chat template writes tool calls in a format paxpage has no parser for; "
                          "start paxpage serve with --tool-call-parser", "tools")
    for t in req.tools:
        if t.function.parameters is not None:
            try:
                StructuredOutputs(json_schema=t.function.parameters)
            except (ValueError, TypeError) as e:
                raise bad_request(f"tools: function {t.function.name!r} parameters: {e}", "tools") from None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = "auto" if choice is None else choice
    if choice in ("none", "auto"):
        return ToolPlan(rendering, tools, choice == "auto", None, req.parallel_tool_calls)
    functions = [(t.function.name, t.function.parameters) for t in req.tools]
    if choice != "required":
        functions = [f for f in functions if f[0] == choice.function.name]
        if not functions:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                              f"{names}", "tool_choice")
    grammar = rendering.parser.grammar(functions, req.parallel_tool_calls, rendering.marker_ids)
    try:
        constraint = StructuredOutputs(grammar=grammar)
    except (ValueError, TypeError) as e:
        raise bad_request(f"tools: the functions' schemas do not compile to a grammar: {e}", "tools") from None
    return ToolPlan(rendering, tools, True, constraint, req.parallel_tool_calls)


def apply_to_params(plan: ToolPlan, params):
    """SamplingParams with the plan's grammar and special-token setting."""
    changes = {}
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with "
                              "another structured output constraint", "tool_choice")
        changes["structured_outputs"] = plan.constraint
    if plan.parse and plan.rendering.keep_special_tokens:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes) if changes else params


def _calls_of(message: ChatMessage) -> list[ParsedCall]:
    calls = []
    for i, tc in enumerate(message.tool_calls or ()):
        try:
            args = json.loads(tc.function.arguments)
        except json.JSONDecodeError as e:
            raise bad_request(f"messages: tool_calls[{i}].function.arguments is not valid JSON: {e}",
                              "messages") from None
        if not isinstance(args, dict):
            raise bad_request(f"messages: tool_calls[{i}].function.arguments must be a JSON object", "messages")
        calls.append(ParsedCall(tc.function.name, json.dumps(args, ensure_ascii=False)))
    return calls


def template_messages(messages: list[ChatMessage], rendering: ToolRendering | None,
                      plan: ToolPlan | None = None) -> tuple[list[dict], list[dict] | None]:
    """(messages for apply_chat_template, its tools argument). rendering None: the template
    is taken to render tool turns itself."""
    rendering = plan.rendering if plan is not None else rendering
    native = rendering is None or rendering.template_renders_tools
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            if native:
                d["tool_calls"] = [{"id": tc.id, "type": "function",
                                    "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                   for tc, c in zip(m.tool_calls, _calls_of(m))]
            else:
                d["content"] = "\n".join(filter(None, (d["content"], rendering.parser.format_calls(_calls_of(m)))))
        if m.tool_call_id is not None:
            if native:
                d["tool_call_id"] = m.tool_call_id
            else:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    if plan is None or plan.tools is None:
        return out, None
    if native:
        return out, plan.tools
    system = _tools_system_text(plan)
    if out and out[0]["role"] in ("system", "developer"):  # one system turn: the client's, then the tools
        return [{**out[0], "content": f"{out[0]['content']}\n\n{system}"}, *out[1:]], None
    return [{"role": "system", "content": system}, *out], None


def _tools_system_text(plan: ToolPlan) -> str:
    functions = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    return ("You can call functions to help answer. The functions, as JSON signatures:\n<tools>\n"
            f"{functions}\n</tools>\nTo call one, answer with exactly:\n{plan.parser.format_hint}")


def tool_call_dicts(plan: ToolPlan, calls: list[ParsedCall]) -> list[dict]:
    return [{"id": plan.parser.new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def read_answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole answer."""
    if not plan.parse:
        return text, []
    content, calls = plan.parser.read(text)
    return content, calls if plan.parallel else calls[:1]


def finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ToolCallStream:
    """One streamed choice: content goes out as it comes until a call may begin; then each call
    as OpenAI streams them (`call_deltas`): its id and name once the name is whole, then its
    arguments' text as it grows. What is left is read when the choice finishes (`finish`,
    `final_deltas`), so the deltas of a call add up to the call of the whole answer."""

    def __init__(self, plan: ToolPlan):
        self._plan, self._text, self._sent, self._in_call = plan, "", 0, False
        self._streamed: list[list] = []  # per call begun: [id, name, the arguments' text sent]
        self._scans: dict = {}  # the JSON values' scans in the calls' text, resumed at each delta

    def feed(self, text: str) -> str:
        self._text += text
        if self._in_call:
            return ""
        end, self._in_call = self._plan.parser.content_end(self._text)
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent:end], end
        return out

    def call_deltas(self) -> list[dict]:
        """The tool-call deltas ({"index", ["id", "type"], "function": {...}}) of what the calls
        have gained since the last time."""
        if not self._in_call:
            return []
        calls = self._plan.parser.partial_calls(self._text[self._sent:], self._scans)
        out = []
        for i, call in enumerate(calls if self._plan.parallel else calls[:1]):
            if call.name is None:
                break  # a call's name goes first
            if i == len(self._streamed):
                self._streamed.append([self._plan.parser.new_call_id(), call.name, ""])
                out.append({"index": i, "id": self._streamed[i][0], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            sent = self._streamed[i][2]
            if call.arguments is not None and len(call.arguments) > len(sent):
                out.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
                self._streamed[i][2] = call.arguments
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not sent yet, the calls)."""
        content, calls = read_answer(self._plan, self._text[self._sent:])
        return content or "", calls

    def final_deltas(self, calls: list[ParsedCall]) -> list[dict]:
        """The deltas that complete `calls` (finish's) after what call_deltas sent."""
        out = []
        for i, call in enumerate(calls):
            if i < len(self._streamed) and self._streamed[i][1] == call.name \
                    and call.arguments.startswith(self._streamed[i][2]):
                rest = call.arguments[len(self._streamed[i][2]):]
                if rest:
                    out.append({"index": i, "function": {"arguments": rest}})
            else:  # not begun (or, for a malformed stream, begun otherwise): the whole call
                out.append({"index": i, "id": self._plan.parser.new_call_id(), "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
        return out
