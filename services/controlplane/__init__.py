"""meshserve's control plane: tells Envoy (over xDS) which gateway replicas exist, and runs Envoy."""
