from django.apps import AppConfig


class TaskflowConfig(AppConfig):
    name = "taskflow"
    verbose_name = "Taskflow"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Handlers live in each installed app's tasks.py, as with Django's own task modules.
        from django.utils.module_loading import autodiscover_modules

        autodiscover_modules("tasks")
