"""The wire between the driver and its workers: authenticated frames and typed, versioned messages.

protocol.py: framed, HMAC-authenticated messages (JSON bodies or raw arrays; never pickles).
codec.py: what every message shares: its wire name, the error for an unknown one, JSON body plus arrays.
messages.py: the job message (``JobMessage``) and the version of every message.
commands.py: what the driver tells its workers after their job, and the heartbeat both sides send.
reports.py: what a worker tells the driver (and a Spark task its backend): one frozen dataclass each.
catalog.py: every message type by its wire name; ``decode_message`` reads any of them, typed.
handover.py: how a worker is handed its job, whoever starts it.
secret.py: the per-run secret handed to a worker on a pipe, never on a command line or in the environment.
shardfile.py: the Arrow IPC shard file a Spark task writes and its worker streams.
"""
