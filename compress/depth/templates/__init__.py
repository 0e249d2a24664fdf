"""Modeling files shipped inside checkpoints (``auto_map`` + ``trust_remote_code``)."""
