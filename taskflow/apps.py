from django.apps import AppConfig


class TaskflowConfig(AppConfig):
    name = "taskflow"
    verbose_name = "Taskflow"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks
        from django.utils.module_loading import autodiscover_modules

        from .checks import check_settings
        from .engine import ids, nodes

        checks.register(check_settings, "taskflow")
        # The id generator knows nothing of the database; its node numbers are leased here.
        ids.use_node_source(nodes.node_source())
        # Handlers live in each installed app's tasks.py, as with Django's own task modules.
        autodiscover_modules("tasks")
