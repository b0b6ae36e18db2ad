"""The router's side: the location feed and index, the scorer, the router and its gRPC server."""
