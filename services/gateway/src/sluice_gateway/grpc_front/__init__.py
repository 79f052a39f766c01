"""The gRPC front: sluice.gateway.v1.GatewayService over the inference path (and the JobsPort for the job RPCs)."""
