"""Hand-off: how the rows one module group produces reach the next group, and their gradients come back.

Owns the module graph's links (``graph``: every edge of one producer -> consumer, moved as one
payload), the routing of a micro-batch onto the producer's units and the consumer's endpoints
(``routing``: pure, on the driver), the channels that move the payloads (``transport``: the object
store, CUDA IPC or the bridge; ``bridge``: the standalone communicators between two groups' worlds)
and a rank's inputs on its device with the tags its payloads carry (``device_io``).

Imports no other room of ``dhp.runtime`` (``lint-imports``, contract ``runtime-rooms``; independent
of ``launch``). Memory: the channel's buffers of the payloads in flight, on the ranks.
"""
