//! Remote storage and SMC transports for ubdirect: the wire protocol, tcp and rdma transports land with the remote-storage issue.
