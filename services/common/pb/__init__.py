"""Generated gRPC stubs (`make proto`); not committed."""
