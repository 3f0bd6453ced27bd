"""What the daemon, the router and the operator share, owned by none of them: the OpenAI request parsing
(protocol, tools, errors), chat-template rendering, Prometheus text parsing, log setup, and model URIs
with their tokenizers. Nothing here imports kvpilot.daemon, kvpilot.router or kvpilot.operator
(tests/test_import_directions.py checks it)."""
