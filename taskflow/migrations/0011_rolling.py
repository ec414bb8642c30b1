# SchedulePos was never used before rolling: it is recreated as one row per history table.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('taskflow', '0010_dependencies'),
    ]

    operations = [
        migrations.DeleteModel(name='SchedulePos'),
        migrations.CreateModel(
            name='SchedulePos',
            fields=[
                ('position', models.PositiveIntegerField(primary_key=True, serialize=False)),
                ('started_at', models.DateTimeField()),
                ('row_count', models.BigIntegerField(default=0, help_text='rows the table holds now')),
                ('min_id', models.BigIntegerField(blank=True, null=True)),
                ('max_id', models.BigIntegerField(blank=True, null=True)),
                ('newest_finished_at', models.DateTimeField(blank=True, help_text='retention drops the table after this', null=True)),
                ('dropped_at', models.DateTimeField(blank=True, null=True)),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'history table',
            },
        ),
    ]
