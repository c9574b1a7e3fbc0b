"""zerowatch.server"""
