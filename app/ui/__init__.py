"""Widgets: thin views over the controllers in app/controllers."""
