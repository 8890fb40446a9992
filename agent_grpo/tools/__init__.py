"""Tools: the `@tool` decorator (`tool.py`), tool-call formats, MCP tools, and the built-ins."""
