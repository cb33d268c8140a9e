"""The trusted side's integrations: an OpenAI-compatible HTTP API, the terminal chat, and their commands.

Applications talk to localhost and never see the split: tokenization, the chat template, sampling and
stop strings all happen here, and only hidden states go to the cloud (through local/client.py).
"""
