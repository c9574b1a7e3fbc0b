"""zerowatch.agent"""
