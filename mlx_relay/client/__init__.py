"""Talking to a running cluster: the client library and the chat/status/generate CLI.

Speaks only the wire protocol (`protocol`), so it never imports the server side.
"""
