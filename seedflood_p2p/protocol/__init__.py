"""Protocol: the update message, and the wire format with every validation rule (`wire.py`)."""
