"""Settings for the taskflow example project; everything deployment-specific comes from the environment."""

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TASKFLOW_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = os.environ.get("DJANGO_DEBUG", "").lower() in {"1", "true", "yes", "on"}
# A missing secret is only tolerated in DEBUG; production must provide DJANGO_SECRET_KEY.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or ("insecure-dev-only-key" if DEBUG else "")
if not SECRET_KEY:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("Set DJANGO_SECRET_KEY (or DJANGO_DEBUG=1 for local development).")

ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

# A deployment behind HTTPS (README, "Production"): TASKFLOW_HTTPS=1 behind a proxy that ends TLS
# and sets X-Forwarded-Proto. Every plain-HTTP request is redirected, cookies travel over HTTPS only,
# and browsers are told (HSTS) to use nothing else. Off by default: `runserver` speaks plain HTTP.
HTTPS = os.environ.get("TASKFLOW_HTTPS", "").lower() in {"1", "true", "yes", "on"}
if HTTPS:
    # The proxy must overwrite this header on every request, or a client could claim HTTPS itself.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # A year, as `check --deploy` asks; TASKFLOW_HSTS_SECONDS shortens it while trying HTTPS out.
    SECURE_HSTS_SECONDS = int(os.environ.get("TASKFLOW_HSTS_SECONDS", 31536000))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True

INSTALLED_APPS = [
    "project.admin.ExampleAdminConfig",  # django.contrib.admin, with its own titles
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "taskflow",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database_from_env() -> dict:
    url = os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'taskflow.sqlite3'}"
    db = dj_database_url.parse(url)
    engine = db["ENGINE"]
    options = db.setdefault("OPTIONS", {})
    if engine.endswith("sqlite3"):
        # IMMEDIATE makes every transaction take the write lock up front, so a claim's
        # read-then-update can never interleave with another process's (SQLite has no row locks).
        options.setdefault("transaction_mode", "IMMEDIATE")
        options.setdefault("timeout", 30)
        options.setdefault("init_command", "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")
        db.setdefault("TEST", {})["NAME"] = str(VAR_DIR / "test_taskflow.sqlite3")
    elif engine.endswith("mysql"):
        options.setdefault("charset", "utf8mb4")
        options.setdefault("isolation_level", "read committed")
    return db


DATABASES = {"default": _database_from_env()}

REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

TASKFLOW = {
    # The django-redis cache alias used for wake-ups, the concurrency limiter and leader
    # election; None means "no Redis": everything falls back to the database.
    "REDIS_ALIAS": "default" if REDIS_URL else None,
}

# Django's own tasks framework (`@task` from django.tasks) runs on taskflow: docs/django-tasks.md.
TASKS = {"default": {"BACKEND": "taskflow.backends.TaskflowBackend"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

# taskflow's API views set their own authentication (token or session, no Basic), permissions and
# errors; these defaults only cover other DRF views the project might add.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.DjangoModelPermissions"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "taskflow API",
    # The Swagger page links only to what exists: the schema it shows, and no terms, contact or
    # external docs (the reference, docs/api.md, ships with the source and its docs site).
    "DESCRIPTION": "Create, hold and report tasks over HTTP: the reference is docs/api.md in taskflow's documentation.",
    "LICENSE": {"name": "MIT"},
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from drf-spectacular-sidecar's static files: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "TaskStatusEnum": "taskflow.models.Status",
        "SetStatusEnum": ["failed", "pending", "stopped", "success"],
        # Two answers have an `outcome`: a bulk create's per task and a batch's per item.
        "EnqueueOutcomeEnum": ["created", "existing", "replaced"],
        "BatchItemOutcomeEnum": ["applied", "refused"],
    },
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Records about one task (a handler's own logging too) name it: task=<id> trace=<trace id>.
    "filters": {"task": {"()": "taskflow.engine.tasklog.TaskLogFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s task=%(task_id)s trace=%(trace_id)s %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["task"]}},
    "loggers": {"taskflow": {"handlers": ["console"], "level": os.environ.get("TASKFLOW_LOG_LEVEL", "INFO")}},
}
