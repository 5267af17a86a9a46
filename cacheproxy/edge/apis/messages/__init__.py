"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as one unit:
`request` (a body as the chat request that asks for the same answer: one cache entry with
chat completions and Responses), `render` (the message object and its typed stream of
events), `errors` (Anthropic's error shape) and `routes` (the handlers)."""
