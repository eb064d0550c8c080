"""Messages between the server's processes, and the loop-driven link that
carries them.

    messages.py   one message: a msgpack header and raw tensor bytes (no pickle)
    link.py       one end of a stream socket on an event loop: messages out
                  without ever blocking the loop, messages in as they complete

A model's worker processes (``runtime/``) and the front-end processes of
``--frontends N`` (``frontends/``) both talk this way.
"""
