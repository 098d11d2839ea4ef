"""The package version: a leaf module, so that writers can record it without importing the
package's public entry points."""

__version__ = "0.1.0"
