"""The Responses API (`POST /v1/responses`) as one unit: `request` (a body as the chat request
that asks for the same answer: one cache entry with chat completions and Messages), `fields`
(the decision on every field of a Responses request: applied, passed, moot or refused), `tools`
(its function and namespace tools, and the thought it asks to carry back), `render` (the
`response` object and its typed stream of events). Its ids are `resp_` and its errors
OpenAI's shape, naming the Responses path of a field a chat check named (`render.error_body`,
`items`: the input items)."""
