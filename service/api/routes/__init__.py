"""One APIRouter per endpoint group; `service.api.app` includes them all."""
