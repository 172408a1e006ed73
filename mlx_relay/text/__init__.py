"""The text layer: what a model reads and writes as text, apart from how it runs.

Chat markup (markup.py), the output parser that splits a stream into content,
reasoning and tool calls (postprocess.py, textstream.py), each tool-call format in one
module of `tool_calls` (its parser, grammar, partial-call reading), the grammars a
request can hold its output to (constraints.py, json_schema.py, tool_grammars.py,
tool_constraint.py), the tool fallback's prompt (tool_prompt.py), and one sequence's
text as the engine sees it (stream.py). The engine hands token ids in and gets text
out, through two matchers (matchers.py): a sequence's `TextStream` (detokenizes, parses,
finds stop strings) and its grammar `Constraint`. Nothing here knows the ring, the
scheduler or a door; the coordinator and the api use it.
"""
