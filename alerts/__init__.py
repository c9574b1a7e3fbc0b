"""zerowatch.alerts"""
