"""Thin click commands: parse, call library code, render. Nothing here holds logic worth testing
apart from the library it calls."""
