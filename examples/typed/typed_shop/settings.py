"""Just enough settings for django-stubs' mypy plugin to read taskflow's models."""

SECRET_KEY = "typed-example-only"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes", "taskflow", "typed_shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
