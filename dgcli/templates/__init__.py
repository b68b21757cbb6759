"""A GGUF's chat template: turned into token ids (chat_template.py), rendered in a limited child
process (sandbox.py) that runs worker.py."""
