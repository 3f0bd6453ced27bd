"""End-to-end proof: the kmock API emulator, the real operator, a node agent that runs real daemons on
loopback addresses, and a load generator using the official openai client."""
