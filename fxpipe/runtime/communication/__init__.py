"""Communication between ranks: point-to-point messages and their backward, the transport, the
mesh of process groups, the backend, data-parallel gradient averaging."""
